"""R·V·D layouts: how one tensor is spread over an ordered group of devices.

A layout keeps ``R`` copies of the tensor (replicas), splits its value into ``V`` partial sums
(value parts: the ``V`` pieces add up to the tensor) and cuts each dim ``k`` into ``D_k``
contiguous chunks. Every device of the group holds exactly one piece.

Canonical device order. Position ``i`` in ``devices`` has the coordinates
``(r, v, d0, d1, ...)`` in row-major order over the counts ``(R, V, D0, D1, ...)``::

    i = ((r * V + v) * D0 + d0) * D1 + d1        (for a 2-D tensor)

and the device at position ``i`` holds value part ``v`` of ``V`` of the box
(chunk ``d0`` of dim 0) × (chunk ``d1`` of dim 1). Example, ``R2V1D(1,2)@[0..3]`` of shape (4, 6):

    position  device  r  v  d0  d1  piece (IndexMask, ValueMask)
    0         0       0  0  0   0   [0:4, 0:3] {0/1}
    1         1       0  0  0   1   [0:4, 3:6] {0/1}
    2         2       1  0  0   0   [0:4, 0:3] {0/1}
    3         3       1  0  0   1   [0:4, 3:6] {0/1}

``R2V1D(1,2)@[0,2,1,3]`` is the same cut with the replicas inner: devices 0 and 1 hold columns 0:3.

Chunk boundaries: a dim of size ``s`` cut into ``n`` chunks gives the first ``s % n`` chunks
``s // n + 1`` indices and the rest ``s // n`` (equal chunks when ``n`` divides ``s``; the search
plans collectives only for equal chunks and moves uneven ones point to point).
"""

from __future__ import annotations

import math
import re
from bisect import bisect_left, bisect_right
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from itertools import product

from lightning_nnscaler.ir.tensor import IndexMask, ValueMask

# Axes of the device array, in canonical (row-major) order: replicas, value parts, then one per dim.
REPLICA_AXIS = 0
VALUE_AXIS = 1
FIRST_DIM_AXIS = 2

_TEXT = re.compile(r"^R(\d+)V(\d+)D\(([\d,\s]*)\)@\[([\d,.\s]*)\]$")


@lru_cache(maxsize=4096)
def chunk_bounds(size: int, parts: int) -> tuple[tuple[int, int], ...]:
    """The ``[start, stop)`` ranges of ``parts`` contiguous chunks of a dim of ``size``, larger ones first."""
    if not 1 <= parts <= size:
        raise ValueError(f"cannot cut a dim of size {size} into {parts} non-empty chunks; use 1..{size} chunks")
    base, extra = divmod(size, parts)
    bounds, start = [], 0
    for chunk in range(parts):
        stop = start + base + (1 if chunk < extra else 0)
        bounds.append((start, stop))
        start = stop
    return tuple(bounds)


@dataclass(frozen=True)
class Layout:
    """A tensor's distribution over an ordered device group as R·V·D (see the module docstring).

    Layouts compare by device order too; ``normalized()`` gives the key under which two layouts
    that place the tensor alike (replicas swapped) are equal.

    Attributes:
        replicas: ``R``, the number of full copies of each piece.
        value_parts: ``V``, the number of partial sums the value is split into.
        dim_splits: ``D``, the number of contiguous chunks per tensor dim.
        devices: The group, in canonical order; ``len(devices) == R * V * prod(D)``.
    """

    replicas: int
    value_parts: int
    dim_splits: tuple[int, ...]
    devices: tuple[int, ...]

    def __post_init__(self) -> None:
        if min((self.replicas, self.value_parts, *self.dim_splits)) < 1:
            raise ValueError(f"layout {self}: every count must be at least 1")
        if len(self.devices) != math.prod(self.counts):
            raise ValueError(
                f"layout R{self.replicas}V{self.value_parts}D{self.dim_splits}: needs "
                f"{math.prod(self.counts)} devices, got {len(self.devices)}"
            )
        if len(set(self.devices)) != len(self.devices):
            raise ValueError(f"layout {self}: a device appears twice in {self.devices}")

    @classmethod
    def parse(cls, text: str) -> Layout:
        """Read the text form, e.g. ``"R2V1D(1,4)@[0..7]"`` or ``"R1V2D(2)@[0,2,1,3]"``."""
        match = _TEXT.match(text.replace(" ", ""))
        if match is None:
            raise ValueError(f"{text!r} is not a layout; write it like 'R2V1D(1,4)@[0..7]'")
        replicas, value_parts, splits, device_text = match.groups()
        dim_splits = tuple(int(split) for split in splits.split(",") if split)
        devices: list[int] = []
        for item in filter(None, device_text.split(",")):
            first, _, last = item.partition("..")
            devices.extend(range(int(first), int(last or first) + 1))
        return cls(int(replicas), int(value_parts), dim_splits, tuple(devices))

    @property
    def counts(self) -> tuple[int, ...]:
        """The device array's shape ``(R, V, D0, D1, ...)``."""
        return (self.replicas, self.value_parts, *self.dim_splits)

    @property
    def group(self) -> frozenset[int]:
        """The devices, unordered."""
        return frozenset(self.devices)

    def coordinates(self, device: int) -> tuple[int, ...]:
        """``(r, v, d0, d1, ...)`` of ``device``."""
        position = self.devices.index(device)
        coordinates = []
        for count in reversed(self.counts):
            position, coordinate = divmod(position, count)
            coordinates.append(coordinate)
        return tuple(reversed(coordinates))

    def piece_of(self, device: int, shape: tuple[int, ...]) -> tuple[IndexMask, ValueMask]:
        """The box and value part ``device`` holds of a tensor of ``shape``."""
        if len(shape) != len(self.dim_splits):
            raise ValueError(
                f"layout {self} cuts {len(self.dim_splits)} dims; the tensor {tuple(shape)} has {len(shape)}"
            )
        _, value_part, *chunks = self.coordinates(device)
        bounds = [chunk_bounds(size, parts) for size, parts in zip(shape, self.dim_splits)]
        ranges = tuple(dim_bounds[chunk] for dim_bounds, chunk in zip(bounds, chunks))
        return IndexMask(ranges), ValueMask(value_part, self.value_parts)

    def pieces(self, shape: tuple[int, ...]) -> dict[int, tuple[IndexMask, ValueMask]]:
        """``piece_of`` for every device, in canonical order."""
        return {device: self.piece_of(device, shape) for device in self.devices}

    def is_even(self, shape: tuple[int, ...]) -> bool:
        """Whether every split divides its dim (all pieces the same shape)."""
        splits = self.dim_splits
        return len(shape) == len(splits) and all(size % parts == 0 for size, parts in zip(shape, splits))

    @classmethod
    def from_pieces(cls, shape: tuple[int, ...], pieces: Mapping[int, tuple[IndexMask, ValueMask]]) -> Layout | None:
        """Recognize the regular layout placing ``pieces`` ({device: (box, value part)}), or ``None``.

        Regular means: all value masks split into the same number of parts; per dim the boxes use
        exactly the chunks of ``chunk_bounds``; every (value part, box) of the grid is held by the
        same number of devices. Holders of one piece become replicas in ascending device order.
        """
        if not pieces or any(len(index.ranges) != len(shape) for index, _ in pieces.values()):
            return None
        if len({value.parts for _, value in pieces.values()}) != 1:
            return None
        value_parts = next(iter(pieces.values()))[1].parts
        dim_starts, dim_splits = [], []
        for dim, size in enumerate(shape):
            ranges = tuple(sorted({index.ranges[dim] for index, _ in pieces.values()}))
            if size < len(ranges) or ranges != chunk_bounds(size, len(ranges)):
                return None
            dim_starts.append([start for start, _ in ranges])
            dim_splits.append(len(ranges))
        block = value_parts * math.prod(dim_splits)
        holders: list[list[int]] = [[] for _ in range(block)]
        for device in sorted(pieces):
            index, value = pieces[device]
            chunks = [bisect_right(starts, start) - 1 for starts, (start, _) in zip(dim_starts, index.ranges)]
            holders[row_major([value.part, *chunks], (value_parts, *dim_splits))].append(device)
        replicas = len(holders[0])
        if any(len(devices) != replicas for devices in holders):
            return None
        devices = tuple(holders[position][replica] for replica in range(replicas) for position in range(block))
        return cls(replicas, value_parts, tuple(dim_splits), devices)

    def normalized(self) -> Layout:
        """The same placement with each piece's replicas in ascending device order (a canonical key)."""
        if self.replicas == 1:
            return self
        block = len(self.devices) // self.replicas
        columns = [sorted(self.devices[position :: block]) for position in range(block)]
        devices = tuple(columns[position][replica] for replica in range(self.replicas) for position in range(block))
        return self if devices == self.devices else Layout(self.replicas, self.value_parts, self.dim_splits, devices)

    def regroup(
        self, source_axis: int, target_axis: int, factor: int
    ) -> tuple[Layout, tuple[tuple[int, ...], ...]]:
        """Move the inner ``factor`` of one axis into another (see ``regroup_order``).

        Returns:
            The new layout and the sub-groups (devices) that exchange data for the move.
        """
        counts, order, groups = regroup_order(self.counts, source_axis, target_axis, factor)
        layout = Layout(counts[0], counts[1], counts[2:], tuple(self.devices[position] for position in order))
        return layout, tuple(tuple(self.devices[position] for position in group) for group in groups)

    def __str__(self) -> str:
        splits = ",".join(str(split) for split in self.dim_splits)
        return f"R{self.replicas}V{self.value_parts}D({splits})@[{_device_text(self.devices)}]"


def _device_text(devices: tuple[int, ...]) -> str:
    """``0..7`` for ascending runs of three or more, commas otherwise."""
    items, start = [], 0
    while start < len(devices):
        stop = start + 1
        while stop < len(devices) and devices[stop] == devices[stop - 1] + 1:
            stop += 1
        if stop - start >= 3:
            items.append(f"{devices[start]}..{devices[stop - 1]}")
        else:
            items.extend(str(device) for device in devices[start:stop])
        start = stop
    return ",".join(items)


# --- geometry the search reads, cached per layout or per counts ---------------------------------


def row_major(coordinates: tuple[int, ...] | list[int], counts: tuple[int, ...]) -> int:
    """Position of ``coordinates`` in a row-major array of shape ``counts``."""
    position = 0
    for coordinate, count in zip(coordinates, counts, strict=True):
        position = position * count + coordinate
    return position


@lru_cache(maxsize=8192)
def regroup_order(
    counts: tuple[int, ...], source_axis: int, target_axis: int, factor: int
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """Move the inner ``factor`` of ``source_axis`` into the inner part of ``target_axis``.

    The coordinate ``x`` on the source axis is ``x = outer * factor + inner``; afterwards the
    source axis counts ``outer`` and the target axis coordinate becomes ``y * factor + inner``.
    This is how every in-group transition rearranges the device array (see ``search.py``).

    Returns:
        The new counts; for each new position the old position of the device now there; and the
        sub-groups (old positions) of devices that differ only in ``inner``, the devices a
        collective for this move runs among.
    """
    new_counts = list(counts)
    new_counts[source_axis] //= factor
    new_counts[target_axis] *= factor
    strides = [math.prod(counts[axis + 1 :]) for axis in range(len(counts))]
    order, groups = [], {}
    for new_coordinates in product(*(range(count) for count in new_counts)):
        outer, inner = divmod(new_coordinates[target_axis], factor)
        old_position = (
            sum(coordinate * stride for coordinate, stride in zip(new_coordinates, strides))
            + (outer - new_coordinates[target_axis]) * strides[target_axis]
            + (new_coordinates[source_axis] * (factor - 1) + inner) * strides[source_axis]
        )
        order.append(old_position)
        # The sub-group: devices with the same new coordinates except the inner part of the target axis.
        key = new_coordinates[:target_axis] + (outer,) + new_coordinates[target_axis + 1 :]
        groups.setdefault(key, []).append(old_position)
    return tuple(new_counts), tuple(order), tuple(tuple(group) for group in groups.values())


@lru_cache(maxsize=4096)
def chunk_overlaps(size: int, have_parts: int, want_parts: int) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """Per chunk of a dim cut into ``want_parts``: the ``(chunk, start, stop)`` overlaps among ``have_parts`` chunks."""
    have, want = chunk_bounds(size, have_parts), chunk_bounds(size, want_parts)
    starts = [start for start, _ in have]
    return tuple(
        tuple(
            (chunk, max(start, have[chunk][0]), min(stop, have[chunk][1]))
            for chunk in range(bisect_right(starts, start) - 1, bisect_left(starts, stop))
        )
        for start, stop in want
    )


@lru_cache(maxsize=4096)
def device_chunks(layout: Layout) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
    """``(device, value part, chunk per dim)`` for every device, in canonical order."""
    entries = []
    for position, device in enumerate(layout.devices):
        chunks = []
        for count in reversed(layout.dim_splits):
            position, chunk = divmod(position, count)
            chunks.append(chunk)
        entries.append((device, position % layout.value_parts, tuple(reversed(chunks))))
    return tuple(entries)


@lru_cache(maxsize=4096)
def piece_holders(layout: Layout) -> dict[tuple[int, tuple[int, ...]], tuple[int, ...]]:
    """{(value part, chunk per dim): the devices holding that piece, replica 0 first}."""
    holders: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    for device, part, chunks in device_chunks(layout):
        holders.setdefault((part, chunks), []).append(device)
    return {piece: tuple(devices) for piece, devices in holders.items()}


def value_sources(have_parts: int, want_parts: int, want_part: int) -> range:
    """The held value parts that sum to part ``want_part`` of ``want_parts`` (empty: it is zeros).

    Finer parts (``want_parts = m·have_parts``) follow ``ValueMask.split``: part ``k·m`` keeps
    held part ``k``, the other ``m - 1`` are zeros. Coarser parts sum the held parts they are made
    of. Otherwise part 0 sums all held parts and the others are zeros.
    """
    if want_parts % have_parts == 0:
        ratio = want_parts // have_parts
        return range(want_part // ratio, want_part // ratio + 1) if want_part % ratio == 0 else range(0)
    if have_parts % want_parts == 0:
        ratio = have_parts // want_parts
        return range(want_part * ratio, (want_part + 1) * ratio)
    return range(have_parts) if want_part == 0 else range(0)


@lru_cache(maxsize=4096)
def device_pieces(layout: Layout, shape: tuple[int, ...]) -> dict[int, tuple[tuple[tuple[int, int], ...], int]]:
    """{device: (box ranges, value part)}: ``Layout.piece_of`` for all devices, as plain tuples."""
    bounds = [chunk_bounds(size, parts) for size, parts in zip(shape, layout.dim_splits)]
    return {
        device: (tuple(dim_bounds[chunk] for dim_bounds, chunk in zip(bounds, chunks)), part)
        for device, part, chunks in device_chunks(layout)
    }


@lru_cache(maxsize=4096)
def overlap_table(
    shape: tuple[int, ...], dtype_bytes: int, have_splits: tuple[int, ...], want_splits: tuple[int, ...]
) -> dict[tuple[int, ...], tuple[tuple[tuple[int, ...], int, tuple[tuple[int, int], ...]], ...]]:
    """{wanted chunks: ((held chunks, bytes, box) for every held piece the wanted box overlaps)}."""
    per_dim = [
        [[(chunk, stop - start, (start, stop)) for chunk, start, stop in overlaps] for overlaps in dim_overlaps]
        for dim_overlaps in (chunk_overlaps(*split) for split in zip(shape, have_splits, want_splits))
    ]
    table = {}
    for chunks in product(*(range(parts) for parts in want_splits)):
        entries = []
        for boxes in product(*(dim_overlaps[chunk] for dim_overlaps, chunk in zip(per_dim, chunks))):
            held_chunks, lengths, ranges = zip(*boxes) if boxes else ((), (), ())
            entries.append((held_chunks, dtype_bytes * math.prod(lengths), ranges))
        table[chunks] = tuple(entries)
    return table


# Every cached table above, for ``search.clear_search_cache``.
GEOMETRY_TABLES = (
    chunk_bounds, regroup_order, chunk_overlaps, device_chunks, piece_holders, device_pieces, overlap_table,
)  # fmt: skip
