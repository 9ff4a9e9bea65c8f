"""The optimizer step overlapped with the gradient sums: each bucket is stepped as soon as its sum arrives.

Under data parallelism the last gradient buckets are still being summed when backward ends, and
DDP's optimizer waits for all of them. ``OverlappedStep`` steps the user's optimizer over one
bucket's parameters as soon as that bucket's sum has arrived (the reducer's ``on_bucket_reduced``),
while the later buckets are still in flight; Lightning's own ``optimizer.step`` then updates only the
parameters no bucket stepped (those held by one rank alone). For an optimizer whose update of a
parameter reads only that parameter, its gradient and its own state (``PER_PARAMETER``), stepping
the parameters in several calls gives bit for bit the update of one call.

The update runs before Lightning's ``on_after_backward`` / ``on_before_optimizer_step`` hooks and
gradient clipping, so it is only allowed when nothing there could read or change a gradient or
decide whether to step (``reasons_not_to_overlap``); otherwise the step waits for every sum, as DDP's does.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from lightning.pytorch import Callback, LightningModule
from torch.optim import Optimizer

PER_PARAMETER: tuple[type[Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adamax, torch.optim.Adadelta,
    torch.optim.RMSprop, torch.optim.NAdam, torch.optim.RAdam,
)
"""Optimizers (these exact classes) whose update of a parameter depends only on it, its gradient and its state."""

_MODULE_HOOKS = ("optimizer_step", "on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping")
_CALLBACK_HOOKS = ("on_after_backward", "on_before_optimizer_step")


def reasons_not_to_overlap(
    module: LightningModule, optimizers: list[Optimizer], callbacks: Iterable[Callback], *, clipping: bool, scaling: bool
) -> list[str]:
    """Why the optimizer must wait for every gradient sum (empty: the overlapped step is exact).

    Args:
        module: The user's LightningModule.
        optimizers: Its optimizers (unwrapped).
        callbacks: The Trainer's callbacks.
        clipping: ``gradient_clip_val`` is set (the clip needs the global norm first).
        scaling: A loss scaler checks for overflow before the step (16-mixed).
    """
    reasons = []
    if not module.automatic_optimization:
        reasons.append("manual optimization")
    if len(optimizers) != 1:
        reasons.append(f"{len(optimizers)} optimizers")
    elif type(optimizers[0]) not in PER_PARAMETER:
        reasons.append(f"{type(optimizers[0]).__name__} is not known to update each parameter on its own")
    elif optimizers[0]._optimizer_step_pre_hooks or optimizers[0]._optimizer_step_post_hooks:
        reasons.append("the optimizer has step hooks")
    if clipping:
        reasons.append("gradient_clip_val")
    if scaling:
        reasons.append("a loss scaler (16-mixed)")
    reasons += [f"{type(module).__name__}.{hook}" for hook in _MODULE_HOOKS if _overrides(module, LightningModule, hook)]
    reasons += [f"{type(callback).__name__}.{hook}" for callback in callbacks for hook in _CALLBACK_HOOKS if _overrides(callback, Callback, hook)]
    return reasons


def _overrides(instance: Any, base: type, hook: str) -> bool:
    return getattr(type(instance), hook, None) is not getattr(base, hook)


class OverlappedStep:
    """Steps ``optimizer`` over each bucket's parameters as their sums arrive (``step_bucket``), then lets
    Lightning's step update only the rest (``hide_stepped`` before it, ``restore`` after it).

    Attributes:
        bucket_steps: How many bucket-wise steps have been taken so far.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        self.bucket_steps = 0
        self._stepped: set[int] = set()
        self._saved_params: list[list[torch.Tensor]] | None = None

    def step_bucket(self, parameters: list[torch.nn.Parameter]) -> None:
        """One optimizer step over those of ``parameters`` the optimizer updates, every group's hyperparameters as they are."""
        wanted = {id(parameter) for parameter in parameters}
        groups = self.optimizer.param_groups
        saved = [group["params"] for group in groups]
        chosen = [[parameter for parameter in params if id(parameter) in wanted] for params in saved]
        if not any(chosen):
            return
        try:
            for group, params in zip(groups, chosen):
                group["params"] = params
            self.optimizer.step()
        finally:
            for group, params in zip(groups, saved):
                group["params"] = params
        self._stepped.update(id(parameter) for params in chosen for parameter in params)
        self.bucket_steps += 1

    def hide_stepped(self) -> None:
        """Until ``restore``: the param groups hold only the parameters no bucket stepped this step."""
        if not self._stepped or self._saved_params is not None:
            return
        groups = self.optimizer.param_groups
        self._saved_params = [group["params"] for group in groups]
        for group, params in zip(groups, self._saved_params):
            group["params"] = [parameter for parameter in params if id(parameter) not in self._stepped]

    def restore(self) -> None:
        """Give the param groups back all their parameters; the next step starts afresh."""
        if self._saved_params is not None:
            for group, params in zip(self.optimizer.param_groups, self._saved_params):
                group["params"] = params
        self._saved_params = None
        self._stepped = set()
