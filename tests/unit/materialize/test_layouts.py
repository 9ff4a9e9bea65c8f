"""R·V·D layouts: text form, canonical device order, pieces, recognition from pieces."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_nnscaler.ir.tensor import IndexMask, ValueMask
from lightning_nnscaler.materialize.layouts import FIRST_DIM_AXIS, REPLICA_AXIS, Layout, chunk_bounds, regroup_order


@pytest.mark.parametrize(
    "text",
    [
        "R2V1D(1,4)@[0..7]", "R1V2D(2)@[0,2,1,3]", "R2V1D(1)@[4,5]", "R1V1D()@[3]", "R1V1D(4,2)@[8..15]",
        "R4V2D(1)@[0..3,8..11]",
    ],  # fmt: skip
)
def test_text_round_trip(text: str) -> None:
    assert str(Layout.parse(text)) == text


def test_text_names_the_fix_for_bad_input() -> None:
    with pytest.raises(ValueError, match="write it like"):
        Layout.parse("R2D(4)@[0..7]")
    with pytest.raises(ValueError, match="needs 8 devices"):
        Layout.parse("R2V1D(4)@[0..3]")
    with pytest.raises(ValueError, match="appears twice"):
        Layout.parse("R2V1D(1)@[0,0]")


def test_canonical_order_is_row_major_over_r_v_d() -> None:
    layout = Layout.parse("R2V2D(1,2)@[0..7]")
    assert [layout.coordinates(device) for device in range(8)] == [
        (0, 0, 0, 0), (0, 0, 0, 1), (0, 1, 0, 0), (0, 1, 0, 1),
        (1, 0, 0, 0), (1, 0, 0, 1), (1, 1, 0, 0), (1, 1, 0, 1),
    ]  # fmt: skip
    assert layout.piece_of(5, (4, 6)) == (IndexMask(((0, 4), (3, 6))), ValueMask(0, 2))
    assert layout.piece_of(6, (4, 6)) == (IndexMask(((0, 4), (0, 3))), ValueMask(1, 2))


def test_replicas_inner_by_device_order() -> None:
    layout = Layout.parse("R2V1D(1,2)@[0,2,1,3]")
    pieces = layout.pieces((4, 6))
    assert pieces[0] == pieces[1] == (IndexMask(((0, 4), (0, 3))), ValueMask())
    assert pieces[2] == pieces[3] == (IndexMask(((0, 4), (3, 6))), ValueMask())


def test_uneven_chunks_put_the_extra_indices_first() -> None:
    assert chunk_bounds(10, 4) == ((0, 3), (3, 6), (6, 8), (8, 10))
    with pytest.raises(ValueError, match="non-empty"):
        chunk_bounds(3, 4)
    with pytest.raises(ValueError, match="cuts 2 dims"):
        Layout.parse("R1V1D(2,2)@[0..3]").piece_of(0, (8,))


def test_normalized_sorts_replicas_of_each_piece() -> None:
    layout = Layout.parse("R2V1D(2)@[3,2,1,0]")
    assert str(layout.normalized()) == "R2V1D(2)@[1,0,3,2]"
    assert layout.normalized().pieces((4,)) == layout.pieces((4,))


def test_regroup_moves_the_inner_factor_and_names_its_sub_groups() -> None:
    # all-gather of dim 0 among pairs: D(4) -> R2 D(2); pairs are the devices differing in the inner bit
    after, groups = Layout.parse("R1V1D(4)@[0..3]").regroup(FIRST_DIM_AXIS, REPLICA_AXIS, 2)
    assert str(after) == "R2V1D(2)@[0,2,1,3]"
    assert groups == ((0, 1), (2, 3))
    counts, order, _ = regroup_order((1, 1, 4), FIRST_DIM_AXIS, REPLICA_AXIS, 2)
    assert counts == (2, 1, 2) and order == (0, 2, 1, 3)


layouts_2d = st.builds(
    lambda r, v, d0, d1, first: Layout(r, v, (d0, d1), tuple(range(first, first + r * v * d0 * d1))),
    st.sampled_from([1, 2, 3]), st.sampled_from([1, 2]), st.sampled_from([1, 2, 4]), st.sampled_from([1, 3]),
    st.integers(0, 4),
)  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(layouts_2d, st.randoms(use_true_random=False))
def test_from_pieces_recognizes_any_regular_layout(layout: Layout, random) -> None:
    shape = (8, 6)
    pieces = layout.pieces(shape)
    shuffled = dict(random.sample(list(pieces.items()), len(pieces)))
    recognized = Layout.from_pieces(shape, shuffled)
    assert recognized is not None
    assert recognized.pieces(shape) == pieces
    assert recognized == layout.normalized()
    assert str(Layout.parse(str(recognized))) == str(recognized)


def test_from_pieces_rejects_irregular_sets() -> None:
    shape = (8,)
    whole = (IndexMask(((0, 8),)), ValueMask())
    half = [(IndexMask(((0, 4),)), ValueMask()), (IndexMask(((4, 8),)), ValueMask())]
    assert Layout.from_pieces(shape, {0: half[0], 1: half[1]}) == Layout.parse("R1V1D(2)@[0,1]")
    assert Layout.from_pieces(shape, {0: half[0], 1: half[1], 2: half[0]}) is None  # replicas differ per piece
    assert Layout.from_pieces(shape, {0: half[0]}) is None  # misses part of the tensor
    uneven = {0: (IndexMask(((0, 3),)), ValueMask()), 1: (IndexMask(((3, 8),)), ValueMask())}
    assert Layout.from_pieces(shape, uneven) is None  # not the chunks of chunk_bounds(8, 2)
    assert Layout.from_pieces(shape, {0: whole, 1: (whole[0], ValueMask(0, 2))}) is None  # mixed value splits
    assert Layout.from_pieces(shape, {0: (whole[0], ValueMask(0, 2)), 1: (whole[0], ValueMask(0, 2))}) is None  # no part 1
    assert Layout.from_pieces((8, 8), {0: whole}) is None  # wrong rank
    assert Layout.from_pieces(shape, {}) is None
