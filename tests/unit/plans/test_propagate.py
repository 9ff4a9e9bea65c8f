"""Split propagation on a small MLP: splits flow on, reductions stop them, placement packs pieces."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_nnscaler as lnn
from lightning_nnscaler.plans.megatron_tp import final_linears, megatron_choice
from lightning_nnscaler.plans.propagate import can_split, place, propagate


class ThreeLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 8)
        self.down = nn.Linear(8, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.down(torch.relu(self.up(x))))).sum()


@pytest.fixture
def mlp() -> tuple[lnn.Graph, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    module = ThreeLinears()
    example = (torch.randn(4, 6),)
    graph = lnn.trace(module, example)
    return graph, lnn.bind_inputs(graph, module, example)


def _origins(ops: list[lnn.Op]) -> list[str]:
    return [op.target.split(".")[1] for op in ops]


def test_batch_seed_flows_through_every_op(mlp) -> None:
    graph, inputs = mlp
    plan = graph.copy()
    walk = propagate(plan, 2, seeds={plan.user_inputs[0].name: 0})
    assert _origins([pieces[0] for pieces in walk.split]) == ["linear", "relu", "linear", "relu", "linear", "sum"]
    assert walk.whole == [] and walk.split[-1][0].outputs[0].value.parts == 2  # the sum over the batch is partial
    place(plan, walk, [0, 1])
    lnn.validate_plan(plan, 2)
    lnn.assert_equivalent(graph, plan, inputs)


def test_megatron_rule_stops_at_the_row_split(mlp) -> None:
    graph, inputs = mlp
    plan = graph.copy()
    assert final_linears(plan) == {next(op.name for op in reversed(plan.ops) if op.target == "aten.linear.default")}
    walk = propagate(plan, 4, choose=megatron_choice(plan))
    assert _origins([pieces[0] for pieces in walk.split]) == ["linear", "relu", "linear"]  # column, follow, row
    assert [piece.outputs[0].value.parts for piece in walk.split[-1]] == [4] * 4
    assert _origins(walk.whole) == ["relu", "linear", "sum"]  # partial sums stop the walk; the head stays whole
    assert len(walk.runs()) == 1
    place(plan, walk, [0, 1])  # 4 pieces on 2 devices: two consecutive pieces each
    assert [plan.op(piece).device for piece in walk.split[0]] == [0, 0, 1, 1]  # (walk handles predate placement)
    assert [op.device for op in plan.ops if op.source_name == walk.whole[0].name] == [0, 1]
    lnn.assert_equivalent(graph, plan, inputs)


class ConvThenMLP(nn.Module):
    """A classifier without attention: the MLP's second linear is the final one (logits)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 4, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(4 * 6, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = torch.relu(self.conv(x)).flatten(1)  # (B, 4 * 6)
        return self.fc2(torch.nn.functional.gelu(self.fc1(features))).sum()


def test_megatron_rule_row_splits_a_final_linear_whose_input_arrives_split() -> None:
    torch.manual_seed(0)
    module, example = ConvThenMLP(), (torch.randn(4, 2, 6),)
    graph = lnn.trace(module, example)
    plan = graph.copy()
    walk = propagate(plan, 2, choose=megatron_choice(plan))
    assert _origins([pieces[0] for pieces in walk.split]) == ["linear", "gelu", "linear"]  # column, follow, row
    fc1, _, fc2 = walk.split
    assert [piece.tensor_inputs[1].index.ranges for piece in fc1] == [((0, 4), (0, 24)), ((4, 8), (0, 24))]
    assert [piece.tensor_inputs[1].index.ranges for piece in fc2] == [((0, 3), (0, 4)), ((0, 3), (4, 8))]
    assert [piece.outputs[0].value.parts for piece in fc2] == [2, 2]  # the logits are all-reduced
    assert _origins(walk.whole)[:3] == ["conv1d", "relu", "flatten"]  # a conv stem starts no split
    place(plan, walk, [0, 1])
    lnn.validate_plan(plan, 2)
    lnn.assert_equivalent(graph, plan, lnn.bind_inputs(graph, module, example))


def test_can_split_checks_names_and_sizes(mlp) -> None:
    graph, _ = mlp
    up = next(op for op in graph.ops if op.target == "aten.linear.default")
    assert can_split(up, "n", 4) and can_split(up, "k", 2)
    assert not can_split(up, "k", 4)  # 6 features
    assert not can_split(up, "q", 2)  # no such name
