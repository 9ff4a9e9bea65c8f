"""Evaluation through the plan: ``validation_step`` and ``test_step`` planned forward-only over the training pieces.

An evaluation step is traced on its first batch of each shape like ``training_step`` (``capture.trace``'s
evaluation steps), planned with the training recipe, and run by an executor over the training plan's
own parameter and buffer pieces (``RankExecutor.sharing_pieces``): no backward, no optimizer, no full
module. What the step logs is computed per data-parallel replica, as in training. A step the plan
cannot run (one that returns more than a number, uses a submodule training does not, or plans to other
pieces) runs on the full LightningModule instead, and the strategy says so once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lightning_nnscaler.runtime.executor import RankExecutor
from lightning_nnscaler.strategy.planning import batch_signature

EVALUATION_CONTEXTS = {"validation_step": "val_step_context", "test_step": "test_step_context"}
"""The precision plugin's context each evaluation step runs in (as Lightning's strategies use them)."""


@dataclass(frozen=True)
class EvaluationCall:
    """One call of an evaluation step, as the loop made it."""

    step: str
    batch: Any
    batch_idx: int
    extra: tuple
    """What the step takes after ``batch_idx``: the ``dataloader_idx`` of a loop over several loaders."""

    @classmethod
    def of(cls, step: str, args: tuple, kwargs: dict[str, Any]) -> EvaluationCall:
        """The call ``step(*args, **kwargs)`` as Lightning's evaluation loop makes it."""
        batch = kwargs.get("batch", args[0] if args else None)
        batch_idx = kwargs.get("batch_idx", args[1] if len(args) > 1 else 0)
        extra = tuple(args[2:]) + ((kwargs["dataloader_idx"],) if "dataloader_idx" in kwargs else ())
        return cls(step, batch, int(batch_idx), extra)

    @property
    def key(self) -> tuple:
        """What a plan is kept by: the step, the batch's shapes and the dataloader index."""
        return (self.step, batch_signature(self.batch), self.extra)


def forward_only(executor: RankExecutor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """This rank's part of the plan's forward (no backward, no optimizer); returns the whole first output.

    Under ZeRO-3 the boxes are gathered from their chunks for it and released after, as for a training step.
    """
    zero3 = executor.reducer.zero_stage == 3
    if zero3:
        executor.reducer.gather_boxes()
    try:
        return executor.forward_backward(inputs, backward=False)
    finally:
        if zero3:
            executor.reducer.release_boxes()
