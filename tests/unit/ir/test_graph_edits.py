"""``Graph.replace_op`` / ``add_op`` keep the order (ops linked by name) and ``Op.evolve`` copies an op with new fields."""

from __future__ import annotations

import pytest

from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir.op import Op


def _op(name: str) -> Op:
    return Op(name, "aten.relu.default", ())


def test_replacing_an_op_puts_its_replacements_in_its_place_and_add_op_appends() -> None:
    graph = Graph(ops=[_op("a"), _op("b"), _op("c")])
    graph.replace_op("b", [_op("b.0"), _op("b.1")])
    graph.replace_op("b.1", [_op("b.1.0"), _op("b.1.1")])
    graph.replace_op("a", [_op("a")])
    graph.replace_op("c", [])
    graph.add_op(_op("d"))
    assert [op.name for op in graph.ops] == ["a", "b.0", "b.1.0", "b.1.1", "d"]
    assert graph.op("b.1.1").name == "b.1.1"
    assert [op.name for op in graph.copy().ops] == [op.name for op in graph.ops]


def test_evolve_changes_the_named_fields_keeps_the_input_pieces_and_refuses_unknown_fields() -> None:
    op = _op("a")
    found = op.tensor_inputs
    moved = op.evolve(device=3, segment=(1, 0))
    assert (moved.name, moved.device, moved.segment, op.device) == ("a", 3, (1, 0), None)
    assert moved.tensor_inputs is found
    assert "tensor_inputs" not in op.evolve(args=()).__dict__
    with pytest.raises(TypeError, match="no fields"):
        op.evolve(colour="red")
