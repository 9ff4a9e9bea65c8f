"""What a recipe promises about the devices before it sees a graph: the device grid and its data-parallel axis.

The strategy needs two facts before tracing, when Lightning builds the DataLoader: how many
data-parallel replicas load different samples, and which replica each rank belongs to (ranks of
one replica — tensor-, sequence-parallel or co-shard pieces — load the same samples). It also
needs, at setup, into how many pieces the recipe cuts attention heads. A recipe declares both
with a layout function ``layout(world_size, params) -> RecipeLayout`` next to its plan function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DATA_AXIS = "dp"


@dataclass(frozen=True)
class DeviceGrid:
    """Ranks laid out row-major over named axes, the last axis varying fastest (like a device mesh).

    ``DeviceGrid.of(dp=2, tp=4)``: rank ``r`` has ``dp`` coordinate ``r // 4`` and ``tp``
    coordinate ``r % 4``, so each tensor-parallel group is 4 consecutive ranks.
    """

    axes: tuple[tuple[str, int], ...]
    """``(axis name, size)`` from the slowest-varying axis to the fastest."""

    @classmethod
    def of(cls, **sizes: int) -> DeviceGrid:
        """A grid with the given axis sizes, in keyword order."""
        for name, size in sizes.items():
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"DeviceGrid axis {name!r} needs a positive int size, got {size!r}")
        return cls(tuple(sizes.items()))

    @property
    def size(self) -> int:
        """Number of ranks."""
        return math.prod(size for _, size in self.axes)

    def axis_size(self, axis: str) -> int:
        """Size of ``axis``; 1 for an axis the grid does not have."""
        return dict(self.axes).get(axis, 1)

    def coordinate(self, rank: int, axis: str) -> int:
        """``rank``'s index along ``axis`` (0 for an axis the grid does not have)."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside the {self.size}-rank grid {self}")
        stride = 1
        for name, size in reversed(self.axes):
            if name == axis:
                return (rank // stride) % size
            stride *= size
        return 0

    def __str__(self) -> str:
        return " × ".join(f"{name}={size}" for name, size in self.axes) or "1 rank"


@dataclass(frozen=True)
class RecipeLayout:
    """A recipe's promise for ``world_size`` ranks, known before tracing."""

    grid: DeviceGrid
    """The ranks as a grid; its ``dp`` axis (if any) numbers the data-parallel replicas."""
    head_pieces: int | None = None
    """Into how many pieces attention heads are cut (None: heads stay whole)."""
    head_reason: str = ""
    """Which setting decides ``head_pieces``, for error messages (e.g. ``"degree=2"``)."""

    @property
    def data_parallel(self) -> int:
        """Replicas that load different samples (the DistributedSampler's ``num_replicas``)."""
        return self.grid.axis_size(DATA_AXIS)

    def replica(self, rank: int) -> int:
        """The replica ``rank`` belongs to (the DistributedSampler's ``rank``)."""
        return self.grid.coordinate(rank, DATA_AXIS)


def single_replica(world_size: int, params: dict[str, object]) -> RecipeLayout:
    """The layout of a recipe that declares none: one replica, every rank loads the same samples.

    Always correct (each rank's code takes what it needs of the replica's batch), at the cost of
    every rank loading every sample.
    """
    return RecipeLayout(DeviceGrid.of(model=world_size))


def data_parallel_layout(world_size: int, params: dict[str, object]) -> RecipeLayout:
    """Every rank its own replica (dp, zero1, zero3)."""
    return RecipeLayout(DeviceGrid.of(dp=world_size))
