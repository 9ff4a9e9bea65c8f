"""Process groups for the ``ranks`` tuples a program's collectives use, created once at setup.

``torch.distributed.new_group`` is itself a collective over the *whole* world: every rank must call
it for every group, in the same order, even for groups it is not in; a rank that skips one or
calls them in another order hangs the job. So groups are never created lazily on first use:
``create_groups`` takes every tuple any rank's program uses, sorts them and creates them all, after
checking that every rank passed the same set (a mismatch raises instead of hanging).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Iterable, Sequence

import torch.distributed as dist
from lightning_nnscaler.ir.errors import NnScalerError


class MissingGroupError(NnScalerError, LookupError):
    """A collective asked for a ``ranks`` tuple that ``create_groups`` was not given."""


class GroupCache:
    """The process group of each ``ranks`` tuple (sorted global ranks).

    The whole world uses the default group and a single rank needs none, so neither is created.

    Args:
        timeout: seconds the backend waits on each new group's collectives.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}

    def create_groups(self, all_rank_tuples: Iterable[Sequence[int]]) -> None:
        """Create a group for each tuple not created yet; a collective call over the whole world.

        Raises:
            ValueError: when ranks passed different sets of tuples; every rank raises.
        """
        world_size = dist.get_world_size()
        needed = sorted(
            {tuple(sorted(ranks)) for ranks in all_rank_tuples} - set(self._groups),
            key=lambda ranks: (len(ranks), ranks),
        )
        needed = [ranks for ranks in needed if 1 < len(ranks) < world_size]
        per_rank: list[list[tuple[int, ...]] | None] = [None] * world_size
        dist.all_gather_object(per_rank, needed)
        differing = [rank for rank, tuples in enumerate(per_rank) if tuples != per_rank[0]]
        if differing:
            raise ValueError(
                f"create_groups must get the same rank tuples on every rank: rank 0 has {per_rank[0]}, "
                f"but ranks {differing} differ (e.g. rank {differing[0]} has {per_rank[differing[0]]}); "
                "pass the union of every rank's tuples"
            )
        for ranks in needed:
            self._groups[ranks] = dist.new_group(list(ranks), timeout=timedelta(seconds=self.timeout))

    def get(self, ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
        """The group of ``ranks``; ``None`` (the default group) for the whole world or a single rank."""
        if len(ranks) == 1 or len(ranks) == dist.get_world_size():
            return None
        try:
            return self._groups[ranks]
        except KeyError:
            raise MissingGroupError(
                f"no process group for ranks {ranks}: pass every ranks tuple the program uses to "
                "create_groups(...) on every rank before the first collective"
            ) from None
