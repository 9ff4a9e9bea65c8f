"""``materialize.written``: the pieces written to a tensor, found by exact match and by overlap as a full scan finds them."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_nnscaler.ir.tensor import IndexMask, PTensor, ValueMask, VTensor
from lightning_nnscaler.materialize.written import Written, WrittenPieces

TENSOR = PTensor("x", (16, 8), "float32", "activation")
RANGES = st.tuples(st.integers(0, 15), st.integers(1, 16)).map(lambda pair: (min(pair), max(pair[1], min(pair) + 1)))
BOXES = st.tuples(RANGES, st.tuples(st.integers(0, 7), st.integers(1, 8)).map(lambda pair: (min(pair), max(pair[1], min(pair) + 1))))


def piece(ranges: tuple, part: int = 0, parts: int = 1) -> VTensor:
    return VTensor(TENSOR, IndexMask(ranges), ValueMask(part, parts))


@settings(max_examples=60, deadline=None)
@given(written=st.lists(BOXES, max_size=24), query=BOXES)
def test_the_overlapping_pieces_are_those_a_scan_finds_in_written_order(written: list[tuple], query: tuple) -> None:
    pieces = WrittenPieces()
    entries = [Written(piece(ranges), rank, f"v{rank}", float(rank)) for rank, ranges in enumerate(written)]
    for entry in entries:
        pieces.add(entry)
    wanted = IndexMask(query)
    assert pieces.overlapping(wanted) == [entry for entry in entries if entry.piece.index.intersect(wanted) is not None]
    assert pieces.entries == entries


def test_exact_lookups_tell_value_parts_apart_and_keep_written_order() -> None:
    pieces = WrittenPieces()
    first, second, other = (Written(piece(((0, 8), (0, 8)), part, 2), rank, f"v{rank}", 0.0) for rank, part in ((0, 0), (1, 0), (2, 1)))
    for entry in (first, other, second):
        pieces.add(entry)
    assert pieces.exactly(IndexMask(((0, 8), (0, 8))), ValueMask(0, 2)) == [first, second]
    assert pieces.exactly(IndexMask(((0, 8), (0, 8))), ValueMask(1, 2)) == [other]
    assert pieces.exactly(IndexMask(((8, 16), (0, 8))), ValueMask(0, 2)) == []


def test_a_scalars_pieces_all_overlap() -> None:
    scalar = PTensor("loss", (), "float32", "activation")
    pieces = WrittenPieces()
    entries = [Written(VTensor(scalar, IndexMask(()), ValueMask(part, 2)), part, f"v{part}", 0.0) for part in range(2)]
    for entry in entries:
        pieces.add(entry)
    assert pieces.overlapping(IndexMask(())) == entries
