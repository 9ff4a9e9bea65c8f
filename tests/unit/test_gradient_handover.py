"""The strategy's gradient handover and overlapped optimizer step, without processes:

- ``OverlappedStep``: stepping a user's optimizer bucket by bucket, then Lightning's step over the
  rest, is bit for bit one step over everything (AdamW with two param groups, SGD with momentum),
  and the param groups are given back as they were.
- ``reasons_not_to_overlap``: every hook, optimizer and setting that could tell the difference turns it off.
- ``GradientStash``: the previous step's gradients are dropped before the step (no second copy alive)
  unless a hook reads them before ``zero_grad``; then they are kept as copies, intact even when the
  step overwrites their storage.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_nnscaler.strategy.gradients import GradientStash, zero_grad_observers
from lightning_nnscaler.strategy.overlap import OverlappedStep, reasons_not_to_overlap


def parameters_and_gradients(seed: int) -> tuple[list[torch.nn.Parameter], list[list[torch.Tensor]]]:
    generator = torch.Generator().manual_seed(seed)
    parameters = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in [(8, 4), (4,), (4, 4), (3,)]]
    gradients = [[torch.randn(p.shape, generator=generator) for p in parameters] for _ in range(5)]
    return parameters, gradients


OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW([{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}], lr=1e-2),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_bucket_by_bucket_steps_equal_one_step_bit_for_bit(name: str) -> None:
    whole, gradients = parameters_and_gradients(0)
    split = [torch.nn.Parameter(p.detach().clone()) for p in whole]
    reference, optimizer = OPTIMIZERS[name](whole), OPTIMIZERS[name](split)
    groups_before = [group["params"] for group in optimizer.param_groups]
    overlap = OverlappedStep(optimizer)
    for step_gradients in gradients:
        for p, q, g in zip(whole, split, step_gradients):
            p.grad, q.grad = g.clone(), g.clone()
        reference.step()
        overlap.step_bucket([split[3], split[2]])  # buckets in reverse registration order, across both groups
        overlap.step_bucket([split[1]])
        overlap.hide_stepped()
        assert [len(group["params"]) for group in optimizer.param_groups] == ([1, 0] if name == "adamw" else [1])
        optimizer.step()  # Lightning's: only the parameter no bucket holds
        overlap.restore()
    assert [group["params"] for group in optimizer.param_groups] == groups_before
    assert overlap.bucket_steps == 2 * len(gradients)
    for p, q in zip(whole, split):
        assert torch.equal(p, q)


class Plain(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)


class ReadsGradients(Plain):
    def on_before_optimizer_step(self, optimizer: Any) -> None:
        pass


class ChangesGradients(Callback):
    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        pass


def test_the_overlap_is_allowed_only_where_nothing_can_tell() -> None:
    module = Plain()
    adamw = torch.optim.AdamW(module.parameters())
    assert reasons_not_to_overlap(module, [adamw], [], clipping=False, scaling=False) == []
    assert reasons_not_to_overlap(module, [adamw], [], clipping=True, scaling=True) == ["gradient_clip_val", "a loss scaler (16-mixed)"]
    assert reasons_not_to_overlap(ReadsGradients(), [adamw], [ChangesGradients()], clipping=False, scaling=False) == [
        "ReadsGradients.on_before_optimizer_step", "ChangesGradients.on_after_backward",
    ]
    assert reasons_not_to_overlap(module, [torch.optim.LBFGS(module.parameters())], [], clipping=False, scaling=False) == [
        "LBFGS is not known to update each parameter on its own"
    ]
    assert reasons_not_to_overlap(module, [adamw, adamw], [], clipping=False, scaling=False) == ["2 optimizers"]
    adamw.register_step_post_hook(lambda *args: None)
    assert reasons_not_to_overlap(module, [adamw], [], clipping=False, scaling=False) == ["the optimizer has step hooks"]
    module.automatic_optimization = False
    assert "manual optimization" in reasons_not_to_overlap(module, [torch.optim.SGD(module.parameters(), lr=0.1)], [], clipping=False, scaling=False)


class WatchesZeroGrad(Plain):
    def on_before_zero_grad(self, optimizer: Any) -> None:
        pass


class KeepsGradients(Callback):
    def on_before_zero_grad(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        pass


def test_hooks_that_read_gradients_before_zero_grad_are_found() -> None:
    assert zero_grad_observers(Plain(), []) == []
    assert zero_grad_observers(WatchesZeroGrad(), [KeepsGradients()]) == ["WatchesZeroGrad.on_before_zero_grad", "KeepsGradients.on_before_zero_grad"]


@pytest.mark.parametrize("keep_earlier", [False, True])
def test_the_stash_drops_the_earlier_gradients_unless_a_hook_reads_them(keep_earlier: bool) -> None:
    holder = torch.nn.Parameter(torch.zeros(3))
    bucket = torch.tensor([1.0, 2.0, 3.0])
    holder.grad = bucket  # the previous step's sum, a view of a bucket
    stash = GradientStash([holder], keep_earlier=keep_earlier)
    seen_during_step = []

    def step() -> torch.Tensor:
        seen_during_step.append(holder.grad)
        bucket.copy_(torch.tensor([10.0, 20.0, 30.0]))  # the step's sum overwrites the bucket in place
        holder.grad = bucket
        return torch.tensor(0.0)

    stash.run_step(step, zero_grad_follows=True)
    assert seen_during_step == [None]
    if keep_earlier:  # what on_before_zero_grad sees: the previous step's gradients, intact
        assert torch.equal(holder.grad, torch.tensor([1.0, 2.0, 3.0])) and holder.grad.data_ptr() != bucket.data_ptr()
    else:
        assert holder.grad is None
    holder.grad = None  # Lightning's zero_grad
    stash.apply()
    assert holder.grad is bucket


@pytest.mark.parametrize("size", [0, -1.0])
def test_a_bucket_size_that_is_not_positive_is_refused_by_name(size: float) -> None:
    from lightning_nnscaler import NnScalerStrategy

    with pytest.raises(ValueError, match=r"bucket_cap_mb=.*positive size in MiB"):
        NnScalerStrategy(bucket_cap_mb=size)
