"""op_trans / op_assign / op_order on traced graphs, and the checks that guard them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_nnscaler as lnn
from lightning_nnscaler.ir.validate import DeadlockError, DeviceOutOfRangeError, UnassignedOpError
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.primitives import AssignError, TransformError


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(7, 8)
        self.second = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x))).sum()


@pytest.fixture
def two_layers() -> tuple[lnn.Graph, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    module = TwoLayers()
    example = (torch.randn(4, 7),)
    graph = lnn.trace(module, example)
    return graph, lnn.bind_inputs(graph, module, example)


def _linears(graph: lnn.Graph) -> list[lnn.Op]:
    return [op for op in graph.ops if op.target == "aten.linear.default"]


def test_split_that_does_not_divide_names_op_dim_and_sizes(two_layers) -> None:
    graph, _ = two_layers
    first = _linears(graph)[0]
    with pytest.raises(TransformError, match=rf"op '{first.name}' \(aten.linear.default\): dim 'k' has size 7, which 2 parts do not divide"):
        lnn.op_trans(graph, first, "k", 2)


def test_frozen_and_unknown_dims_are_refused(two_layers) -> None:
    graph, _ = two_layers
    first = _linears(graph)[0]
    with pytest.raises(TransformError, match="has no dim 'q'"):
        lnn.op_trans(graph, first, "q", 2)
    relu = next(op for op in graph.ops if op.target == "aten.relu.default")
    with pytest.raises(TransformError, match="not linear"):
        lnn.op_trans(graph, relu, "value", 2)


def test_megatron_style_split_is_equivalent(two_layers) -> None:
    graph, inputs = two_layers
    plan = graph.copy()
    first, second = _linears(plan)
    column = lnn.op_trans(plan, first, "n", 2)  # output features
    relu = next(op for op in plan.ops if op.target == "aten.relu.default")
    lnn.op_trans(plan, relu, "b", 2)
    row = lnn.op_trans(plan, second, "k", 2)  # reduction: partial sums
    assert [piece.outputs[0].value.parts for piece in row] == [2, 2]
    assert row[1].tensor_inputs[2].value.part == 1  # the bias is value-split, not added twice
    for index, op in enumerate(plan.ops):
        lnn.op_assign(plan, op, index % 2)
    lnn.validate_plan(plan, world_size=2)
    lnn.assert_equivalent(graph, plan, inputs)
    assert len(column) == 2


def test_pieces_can_be_split_again(two_layers) -> None:
    graph, inputs = two_layers
    plan = graph.copy()
    halves = lnn.op_trans(plan, _linears(plan)[1], "a", 2)
    quarters = lnn.op_trans(plan, halves[0], "k", 4)
    assert quarters[3].name == f"{halves[0].name}.3" and quarters[3].origin == halves[0].origin
    assert quarters[3].outputs[0].value.parts == 4
    lnn.assert_equivalent(graph, plan, inputs)


def test_unassigned_op_is_named(two_layers) -> None:
    graph, _ = two_layers
    pieces = lnn.op_trans(graph, _linears(graph)[0], "a", 2)
    for op in graph.ops:
        if op.name != pieces[1].name:
            lnn.op_assign(graph, op, 0)
    with pytest.raises(UnassignedOpError, match=pieces[1].name.replace(".", r"\.")):
        lnn.validate_plan(graph, world_size=2)


def test_out_of_range_device_is_named(two_layers) -> None:
    graph, _ = two_layers
    for op in graph.ops:
        lnn.op_assign(graph, op, 0)
    last = graph.ops[-1]
    lnn.op_assign(graph, last, 5)
    with pytest.raises(DeviceOutOfRangeError, match=rf"{last.name}.*5"):
        lnn.validate_plan(graph, world_size=4)
    with pytest.raises(AssignError, match="non-negative int"):
        lnn.op_assign(graph, last, -1)


def test_cyclic_order_is_refused_with_the_cycle(two_layers) -> None:
    graph, _ = two_layers
    first, second = _linears(graph)
    before = list(graph.ops)
    with pytest.raises(DeadlockError) as error:
        lnn.op_order(graph, second, first)  # second reads what first writes
    assert error.value.cycle[0] == error.value.cycle[-1]
    assert {first.name, second.name} <= set(error.value.cycle)
    assert list(graph.ops) == before and graph.order_edges == []


def test_order_edges_reorder_independent_ops_and_follow_pieces() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig.small())
    batch = model.example_batch(2)
    graph = lnn.trace(model, batch, step="training_step")
    value_proj, query_proj = (next(op for op in graph.ops if op.target == "aten.linear.default" and op.args[1].tensor.state_key == f"blocks.0.attn.{name}_proj.weight") for name in ("v", "q"))
    lnn.op_order(graph, value_proj, query_proj)
    assert graph.index_of(value_proj) < graph.index_of(query_proj)
    pieces = lnn.op_trans(graph, value_proj, "n", 2)
    assert graph.order_edges == [(piece.name, query_proj.name) for piece in pieces]
    lnn.assert_equivalent(lnn.trace(model, batch, step="training_step"), graph, lnn.bind_inputs(graph, model, batch, step="training_step"))


def test_constraints_bound_splits_and_placements(two_layers) -> None:
    graph, _ = two_layers
    first = _linears(graph)[0]
    constraints = lnn.Constraints().allow_split("aten.linear*", ["b", "n"], [2, 4]).place(first.name, [0, 1])
    assert constraints.allows_split(first, "n", 2) and not constraints.allows_split(first, "k", 2)
    assert constraints.allows_split(first, "replicate", 3)
    for op in graph.ops:
        lnn.op_assign(graph, op, 3)
    with pytest.raises(lnn.primitives.ConstraintError, match=first.name):
        constraints.check(graph)
