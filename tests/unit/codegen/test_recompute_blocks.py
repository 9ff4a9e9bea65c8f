"""A recompute group that something outside it reads before it ends is cut into contiguous blocks, each recomputed."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

import lightning_nnscaler as lnn
from lightning_nnscaler.plans.catalog import apply_recipe
from lightning_nnscaler.plans.recompute import op_recompute


class TwoMLPs(nn.Module):
    """Two Linear-ReLU-Linear stacks in a row: the first's partial sums are all-reduced before the second."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.second = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))

    def training_step(self, batch: torch.Tensor, batch_idx: int = 0) -> torch.Tensor:
        return F.mse_loss(self.second(self.first(batch)), batch)


def test_a_group_spanning_an_all_reduce_is_recomputed_in_two_blocks() -> None:
    torch.manual_seed(0)
    model, batch = TwoMLPs(), torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    graph = lnn.trace(model, batch, step="training_step")
    planned = graph.copy()
    apply_recipe(planned, "tp", 2)
    for op in list(planned.ops):
        if op.target in ("aten.linear.default", "aten.relu.default"):
            op_recompute(planned, op, 0)  # one group per device over both stacks: the all-reduce reads it midway
    plan = lnn.build_plan(model, batch, "training_step", graph, planned, 2)
    for source in plan.sources:
        assert re.findall(r"def (recompute_\d+(?:_\d+)?)\(", source) == ["recompute_0_0", "recompute_0_1"]
        assert source.count("= checkpoint(recompute_0_") == 2
    report = plan.verify()
    assert report.loss == report.reference_loss
