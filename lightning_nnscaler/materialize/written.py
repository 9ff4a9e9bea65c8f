"""The pieces of one tensor written so far during materialization, found by exact match or by overlap.

A reader's piece is served by the written pieces whose boxes overlap it. Scanning every written piece of
the tensor would cost O(pieces) per reader: with ``dp`` data-parallel replicas each tensor has O(dp) pieces
and O(dp) readers, O(dp²) in all. Written pieces are kept sorted by the start of their box on dim 0 (the
batch dim, which the replicas and microbatches cut), so a query looks only at the boxes whose start lies in
``(start - widest, stop)`` (found by bisection), as ``ir.validate``'s box index does for the whole graph.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from typing import NamedTuple

from lightning_nnscaler.ir.tensor import IndexMask, ValueMask, VTensor


class Written(NamedTuple):
    """A piece written on ``rank`` into variable ``var`` by the op at ``position``."""

    piece: VTensor
    rank: int
    var: str
    position: float


class WrittenPieces:
    """The pieces written to one tensor, in the order they were written (``entries``), with lookups."""

    def __init__(self) -> None:
        self.entries: list[Written] = []
        self._exact: dict[tuple[IndexMask, ValueMask], list[Written]] = defaultdict(list)
        self._starts: list[int] = []  # dim-0 starts, sorted
        self._order: list[int] = []  # beside each start: the entry's index in ``entries``
        self._widest = 0

    def add(self, entry: Written) -> None:
        """Record a written piece."""
        start, stop = _first_range(entry.piece.index)
        at = bisect.bisect_right(self._starts, start)
        self._starts.insert(at, start)
        self._order.insert(at, len(self.entries))
        self._widest = max(self._widest, stop - start)
        self.entries.append(entry)
        self._exact[(entry.piece.index, entry.piece.value)].append(entry)

    def exactly(self, index: IndexMask, value: ValueMask) -> list[Written]:
        """The pieces written with this box and value part, in written order."""
        return self._exact.get((index, value), [])

    def overlapping(self, index: IndexMask) -> list[Written]:
        """The pieces whose box overlaps ``index``, in written order."""
        start, stop = _first_range(index)
        low = bisect.bisect_right(self._starts, start - self._widest)
        high = bisect.bisect_left(self._starts, stop)
        found = sorted(position for position in self._order[low:high] if self.entries[position].piece.index.intersect(index) is not None)
        return [self.entries[position] for position in found]


def _first_range(index: IndexMask) -> tuple[int, int]:
    """The box's range on dim 0; a scalar's boxes all sit at ``[0, 1)``."""
    return index.ranges[0] if index.ranges else (0, 1)
