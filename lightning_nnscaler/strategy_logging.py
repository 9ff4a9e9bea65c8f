"""Which ``self.log`` calls of a user's ``training_step`` ``NnScalerStrategy`` can replay.

The parallelized step computes the loss and nothing else the user's ``training_step`` logs. So,
once at setup, the step is run eagerly (without gradients) with ``log``/``log_dict`` recording
their calls: the calls that log the returned loss are replayed with the parallel step's loss on
every step (same name, same options, e.g. ``sync_dist=True``); any other logged value is reported
once, since it is not computed.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_warn


def record_loss_logs(module: LightningModule, batch: Any, batch_idx: int) -> list[tuple[str, dict[str, Any]]]:
    """Run ``module.training_step(batch, batch_idx)`` once and return the ``(name, log options)`` of
    every ``self.log``/``self.log_dict`` call whose value is the returned loss."""
    calls: list[tuple[str, Any, dict[str, Any]]] = []

    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        calls.append((name, value, kwargs))

    def log_dict(dictionary: Any, *args: Any, **kwargs: Any) -> None:
        calls.extend((name, value, kwargs) for name, value in dict(dictionary).items())

    own = {name: module.__dict__[name] for name in ("log", "log_dict") if name in module.__dict__}
    module.log, module.log_dict = log, log_dict  # type: ignore[method-assign]
    try:
        with torch.no_grad():
            output = module.training_step(batch, batch_idx)
    finally:
        for name in ("log", "log_dict"):
            if name in own:
                setattr(module, name, own[name])
            else:
                delattr(module, name)
    loss = output.get("loss") if isinstance(output, dict) else output
    replayed = [(name, kwargs) for name, value, kwargs in calls if value is loss]
    skipped = [name for name, value, _ in calls if value is not loss]
    if skipped:
        rank_zero_warn(
            f"{type(module).__name__}.training_step logs {', '.join(map(repr, skipped))}, which NnScalerStrategy does not "
            "compute (the parallelized step computes the returned loss only), so they are not logged during training. "
            "Log them from validation_step, or log the returned loss itself."
        )
    return replayed
