"""One cost rule per op: the stage balancer prices matmuls as the simulator does (``ir.work.op_work``).

GPT-2's ``Conv1D`` is ``addmm(bias, x, weight)``: its contracted size is ``x``'s last dim, not the bias's.
"""

from __future__ import annotations

import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.plans.stage_cuts import op_cost
from lightning_nnscaler.sim.costs import op_work


class Conv1D(torch.nn.Module):
    """GPT-2's projection: ``x @ weight + bias`` as one ``addmm``."""

    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(inputs, outputs))
        self.bias = torch.nn.Parameter(torch.zeros(outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x, self.weight)


def test_the_balancer_and_the_simulator_price_addmm_alike() -> None:
    graph = lnn.trace(Conv1D(64, 16), (torch.randn(8, 64),))
    addmm = next(op for op in graph.ops if op.target == "aten.addmm.default")
    assert op_cost(addmm) == op_work(addmm).flops == 2.0 * 8 * 16 * 64  # K = 64, x's last dim (not the bias's 16)


def test_every_matmul_is_priced_by_its_flops_in_both() -> None:
    graph = lnn.trace(torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 8)), (torch.randn(4, 32),))
    assert sum(op_work(op).matmul for op in graph.ops) == 2
    for op in graph.ops:
        work = op_work(op)
        if work.matmul:
            assert op_cost(op) == work.flops
