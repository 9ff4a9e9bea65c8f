"""IR objects: masks, annotations and the text form."""

from __future__ import annotations

import pytest

from lightning_nnscaler.ir.annotation import AnnotationError, DimAnnotation
from lightning_nnscaler.ir.graph import Graph, GraphError
from lightning_nnscaler.ir.tensor import IndexMask, PTensor, ValueMask, VTensor

GRAPH_TEXT = """\
tensor %x: float32[4, 8] input
tensor %p_weight: float32[16, 8] parameter "layer.weight" grad
tensor %y: float32[4, 16] activation
op linear.0 @0 from linear = aten.linear.default(%x[0:2, 0:8], %p_weight) -> %y[0:2, 0:16] :: "b k+, n k+ -> b n; value 0"
op linear.1 @1 from linear recompute 2 = aten.linear.default(%x[2:4, 0:8], %p_weight) -> %y[2:4, 0:16]{1/2} :: "b k+, n k+ -> b n; value 0"
op view @1 = aten.view.default(%y, [4, 4, 4], dtype=torch.float32, fill=-inf, device=torch.device('cpu')) -> %y :: "a (b c) -> a b c; value 0"
output %y
order linear.0 -> linear.1
"""


def test_text_form_round_trips() -> None:
    graph = Graph.from_text(GRAPH_TEXT)
    assert str(graph) == GRAPH_TEXT
    assert graph.tensors["p_weight"].state_key == "layer.weight"
    assert graph.op("linear.1").outputs[0].value == ValueMask(1, 2)
    assert graph.op("linear.1").device == 1
    assert graph.order_edges == [("linear.0", "linear.1")]


def test_unknown_op_lookup_names_its_pieces() -> None:
    graph = Graph.from_text(GRAPH_TEXT)
    with pytest.raises(GraphError, match=r"partitioned into \['linear.0', 'linear.1'\]"):
        graph.op("linear")


def test_index_masks_split_and_intersect() -> None:
    mask = IndexMask.full((4, 6))
    left, right = mask.split(1, 2)
    assert left.ranges == ((0, 4), (0, 3)) and right.ranges == ((0, 4), (3, 6))
    assert left.intersect(right) is None
    assert IndexMask(((1, 3), (2, 5))).intersect(left) == IndexMask(((1, 3), (2, 3)))
    assert IndexMask(((1, 3), (2, 3))).slices_within(left) == (slice(1, 3), slice(2, 3))


def test_value_masks_nest() -> None:
    assert ValueMask(1, 2).split(2) == [ValueMask(2, 4), ValueMask(3, 4)]
    with pytest.raises(ValueError):
        ValueMask(2, 2)


def test_pieces_overlap_only_on_the_same_tensor() -> None:
    a, b = PTensor("a", (4,)), PTensor("b", (4,))
    first, second = a.full().split_dim(0, 2)
    assert not first.overlaps(second)
    assert first.overlaps(a.full())
    assert not first.overlaps(VTensor(b, first.index))
    assert str(second) == "%a[2:4]" and str(a.full().split_value(2)[1]) == "%a{1/2}"


def test_annotation_parses_and_prints() -> None:
    text = "b s (h d), n k^ 1, () -> b s h d; value 0 2"
    annotation = DimAnnotation.parse(text)
    assert str(annotation) == text
    assert annotation.frozen == {"k"}
    assert annotation.value_inputs == (0, 2)
    assert annotation.splittable_names() == ["b", "s", "h", "n"]
    assert annotation.inputs[2] == ()


def test_annotation_sizes_follow_shapes() -> None:
    annotation = DimAnnotation.parse("b (h d) -> b h d")
    assert annotation.name_sizes([(2, 12)], [(2, 3, 4)]) == {"b": 2, "h": 3, "d": 4}
    with pytest.raises(AnnotationError, match="has sizes"):
        DimAnnotation.parse("b k, b -> b").name_sizes([(2, 3), (4,)], [(2,)])


@pytest.mark.parametrize("text", ["a b", "a (b -> a", "a ((b c)) -> a", "a -> a; value 3", "a $ -> a"])
def test_malformed_annotations_are_refused(text: str) -> None:
    with pytest.raises(AnnotationError):
        DimAnnotation.parse(text)
