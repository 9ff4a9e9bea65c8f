"""Literal annotation texts of selected ops, and the reshape helper they are built from."""

from __future__ import annotations

import pytest
import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.ir.rules.shape import reshape_specs
from lightning_nnscaler.ir.rules import annotate_op
from lightning_nnscaler.ir.op import Op
from lightning_nnscaler.ir.tensor import PTensor, VTensor


def tensor(name: str, *shape: int, dtype: str = "float32") -> VTensor:
    return PTensor(name, shape, dtype).full()


def annotation(target: str, *args: object, outputs: list[VTensor], **kwargs: object) -> str | None:
    return annotate_op(Op("op", target, args, tuple(kwargs.items()), tuple(outputs)))


def qkv(name: str, length: int = 16) -> VTensor:
    return tensor(name, 2, 4, length, 8)  # (B, nh, T, hs)


ANNOTATIONS = {
    "linear with bias": (
        annotation("aten.linear.default", tensor("x", 2, 16, 32), tensor("w", 64, 32), tensor("b", 64), outputs=[tensor("y", 2, 16, 64)]),
        "a b k+, n k+, n -> a b n; value 0 2",
    ),
    "linear without bias": (
        annotation("aten.linear.default", tensor("x", 8, 32), tensor("w", 64, 32), outputs=[tensor("y", 8, 64)]),
        "a k+, n k+ -> a n; value 0",
    ),
    "view merging dims": (
        annotation("aten.view.default", tensor("x", 2, 16, 4, 8), [2, 16, 32], outputs=[tensor("y", 2, 16, 32)]),
        "a b c d -> a b (c d); value 0",
    ),
    "view splitting a dim": (
        annotation("aten.view.default", tensor("x", 2, 16, 32), [2, 16, 4, -1], outputs=[tensor("y", 2, 16, 4, 8)]),
        "a b (c d) -> a b c d; value 0",
    ),
    "view regrouping dims": (
        annotation("aten.view.default", tensor("x", 6, 4), [4, 6], outputs=[tensor("y", 4, 6)]),
        "a^ b^ -> c^ d^; value 0",
    ),
    "permute": (
        annotation("aten.permute.default", tensor("x", 2, 16, 4, 8), [0, 2, 1, 3], outputs=[tensor("y", 2, 4, 16, 8)]),
        "a b c d -> a c b d; value 0",
    ),
    "transpose": (
        annotation("aten.transpose.int", tensor("x", 2, 16, 4, 8), -2, 1, outputs=[tensor("y", 2, 4, 16, 8)]),
        "a b c d -> a c b d; value 0",
    ),
    "causal attention: query rows stay whole": (
        annotation("aten.scaled_dot_product_attention.default", qkv("q"), qkv("k"), qkv("v"), None, 0.0, True, outputs=[qkv("o")]),
        "b h l^ e^, b h s^ e^, b h s^ f -> b h l^ f; value 2",
    ),
    "attention with a mask broadcast over heads": (
        annotation("aten.scaled_dot_product_attention.default", qkv("q"), qkv("k", 12), qkv("v", 12), tensor("m", 2, 1, 16, 12), outputs=[qkv("o")]),
        "b h l e^, b h s^ e^, b h s^ f, b 1 l s^ -> b h l f; value 2",
    ),
    "layer_norm": (
        annotation("aten.layer_norm.default", tensor("x", 2, 16, 32), [32], tensor("w", 32), tensor("b", 32), 1e-5, outputs=[tensor("y", 2, 16, 32)]),
        "a b f0^, f0^, f0^ -> a b f0^",
    ),
    "embedding": (
        annotation("aten.embedding.default", tensor("w", 128, 32), tensor("i", 2, 16, dtype="int64"), outputs=[tensor("y", 2, 16, 32)]),
        "v+ d, a b -> a b d; value 0",
    ),
    "cross-entropy sum: a batch split leaves partial losses": (
        annotation("aten.cross_entropy_loss.default", tensor("x", 32, 128), tensor("t", 32, dtype="int64"), None, 2, -100, 0.0, outputs=[tensor("l")]),
        "n+ c^, n+ -> ()",
    ),
    "cross-entropy sum over a sequence": (
        annotation("aten.cross_entropy_loss.default", tensor("x", 2, 128, 16), tensor("t", 2, 16, dtype="int64"), None, 2, -100, 0.0, outputs=[tensor("l")]),
        "n+ c^ d0+, n+ d0+ -> ()",
    ),
    "cat": (
        annotation("aten.cat.default", [tensor("x", 2, 3, 4), tensor("y", 2, 5, 4)], 1, outputs=[tensor("z", 2, 8, 4)]),
        "a d^ c, a e^ c -> a f^ c; value 0 1",
    ),
    "stack": (
        annotation("aten.stack.default", [tensor("x", 2, 3), tensor("y", 2, 3)], 1, outputs=[tensor("z", 2, 2, 3)]),
        "a c, a c -> a 2 c; value 0 1",
    ),
    "sum over a dim, kept": (
        annotation("aten.sum.dim_IntList", tensor("x", 2, 16, 32), [1], True, outputs=[tensor("z", 2, 1, 32)]),
        "a b+ c -> a 1 c; value 0",
    ),
    "count of a bool mask: bools have no partial sums": (
        annotation("aten.sum.default", tensor("x", 2, 16, dtype="bool"), outputs=[tensor("z", dtype="int64")]),
        "a+ b+ -> ()",
    ),
    "float to int conversion rounds each value part": (
        annotation("aten.to.dtype", tensor("x", 2, 16), torch.int64, outputs=[tensor("z", 2, 16, dtype="int64")]),
        "a b -> a b",
    ),
    "int to float conversion adds up exactly": (
        annotation("aten.to.dtype", tensor("x", 2, 16, dtype="int64"), torch.float32, outputs=[tensor("z", 2, 16)]),
        "a b -> a b; value 0",
    ),
    "pad with a constant other than 0": (
        annotation("aten.pad.default", tensor("x", 4, 6), [1, 1], "constant", 2.0, outputs=[tensor("z", 4, 8)]),
        "a b^ -> a c^",
    ),
    "pad with zeros": (
        annotation("aten.pad.default", tensor("x", 4, 6), [1, 1], outputs=[tensor("z", 4, 8)]),
        "a b^ -> a c^; value 0",
    ),
    "advanced index with broadcast index tensors": (
        annotation("aten.index.Tensor", tensor("x", 8, 8, 4), [tensor("i", 2, 1, dtype="int64"), tensor("j", 1, 3, dtype="int64")], outputs=[tensor("z", 2, 3, 4)]),
        "a^ b^ c, d 1, 1 e -> d e c; value 0",
    ),
    "gather": (
        annotation("aten.gather.default", tensor("x", 2, 16, 128), 2, tensor("i", 2, 16, 1, dtype="int64"), outputs=[tensor("z", 2, 16, 1)]),
        "a b c^, a b d -> a b d; value 0",
    ),
    "squeeze": (
        annotation("aten.squeeze.default", tensor("x", 4, 1, 6), outputs=[tensor("z", 4, 6)]),
        "a 1 b -> a b; value 0",
    ),
}


@pytest.mark.parametrize("case", list(ANNOTATIONS))
def test_annotation_text(case: str) -> None:
    actual, expected = ANNOTATIONS[case]
    assert actual == expected
    assert str(lnn.DimAnnotation.parse(expected)) == expected


def test_mean_cross_entropy_is_left_to_capture() -> None:
    # A mean needs the global count of targets: capture rewrites it as sum / count instead.
    logits, targets = tensor("x", 32, 128), tensor("t", 32, dtype="int64")
    assert annotation("aten.cross_entropy_loss.default", logits, targets, None, 1, -100, 0.0, outputs=[tensor("l")]) is None


@pytest.mark.parametrize(
    ("source", "target", "expected"),
    [
        ((2, 16, 32), (2, 16, 4, 8), (["a", "b", "(c d)"], ["a", "b", "c", "d"])),
        ((2, 16, 4, 8), (2, 16, 32), (["a", "b", "c", "d"], ["a", "b", "(c d)"])),
        ((2, 3, 4), (24,), (["a", "b", "c"], ["(a b c)"])),
        ((6, 4), (4, 6), (["a^", "b^"], ["c^", "d^"])),
        ((2, 6, 4, 5), (2, 4, 6, 5), (["a", "b^", "c^", "f"], ["a", "d^", "e^", "f"])),
        ((2, 1, 4), (2, 4), (["a", "1", "b"], ["a", "b"])),
        ((4,), (1, 4, 1), (["a"], ["1", "a", "1"])),
        ((6,), (2, 1, 3), (["(a b c)"], ["a", "b", "c"])),
    ],
)
def test_reshape_specs(source: tuple[int, ...], target: tuple[int, ...], expected: tuple[list[str], list[str]]) -> None:
    assert reshape_specs(source, target) == expected


def _one_op_graph(text: str) -> lnn.Graph:
    return lnn.Graph.from_text(text)


def test_squeeze_of_a_split_piece_keeps_dims_that_become_1() -> None:
    # x (4, 1, 6) split by 'a' into 4 leaves pieces (1, 1, 6): a bare squeeze would drop both 1s.
    graph = _one_op_graph(
        'tensor %x: float32[4, 1, 6] input\n'
        'tensor %y: float32[4, 6] activation\n'
        'op squeeze = aten.squeeze.default(%x) -> %y :: "a 1 b -> a b; value 0"\n'
        'output %y\n'
    )
    plan = graph.copy()
    pieces = lnn.op_trans(plan, "squeeze", "a", 4)
    assert [(piece.target, piece.args[1]) for piece in pieces] == [("aten.squeeze.dims", [1])] * 4
    lnn.assert_equivalent(graph, plan, {"x": torch.randn(4, 1, 6)})


def test_view_piece_takes_its_own_shape() -> None:
    graph = _one_op_graph(
        'tensor %x: float32[2, 16, 32] input\n'
        'tensor %y: float32[2, 16, 4, 8] activation\n'
        'op view = aten.view.default(%x, [2, 16, 4, -1]) -> %y :: "a b (c d) -> a b c d; value 0"\n'
        'output %y\n'
    )
    plan = graph.copy()
    pieces = lnn.op_trans(plan, "view", "c", 2)
    assert [piece.args[1] for piece in pieces] == [[2, 16, 2, 8]] * 2
    assert [str(piece.tensor_inputs[0]) for piece in pieces] == ["%x[0:2, 0:16, 0:16]", "%x[0:2, 0:16, 16:32]"]
    lnn.assert_equivalent(graph, plan, {"x": torch.randn(2, 16, 32)})


class ShiftsLabelsRight(torch.nn.Module):
    """Decoder inputs made as T5 makes them: ``labels.new_zeros(labels.shape)`` with labels shifted in."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16)

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        shifted = labels.new_zeros(labels.shape)
        shifted[:, 1:] = labels[:, :-1].clone()
        logits = self.head(self.embedding(shifted))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 16), labels.reshape(-1))


def test_a_template_factory_takes_no_tensor_input_so_data_parallel_ranks_read_their_rows() -> None:
    torch.manual_seed(0)
    labels = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(0))
    graph = lnn.trace(ShiftsLabelsRight(), (labels,))
    (zeros,) = [op for op in graph.ops if "zeros" in op.target]
    assert zeros.target == "aten.zeros.default" and not zeros.tensor_inputs and zeros.kwargs_dict["dtype"] == torch.int64
    lnn.parallelize(ShiftsLabelsRight(), (labels,), "dp", 4).verify()
