"""What ``NnScalerStrategy`` logs: the user's loss logs it can replay, and the plan it runs.

**Loss logs.** The parallelized step computes the loss and nothing else the user's ``training_step`` logs. So,
once at setup, the step is run eagerly (without gradients) with ``log``/``log_dict`` recording
their calls: the calls that log the returned loss are replayed with the parallel step's loss on
every step (same name, same options, e.g. ``sync_dist=True``); any other logged value is reported
once, since it is not computed.

**The plan** (``log_plan``, once per fit, when the first batch was planned): every logger's
``log_hyperparams`` gets the plan summary (recipe and parameters, world size, plan hash, and per
rank the very rows ``Plan.explain`` prints: memory estimate and bytes sent per step); a ``WandbLogger`` also gets it in the run summary, with the generated per-rank
code saved among the run's files.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.loggers import Logger, WandbLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn

from lightning_nnscaler.explain import COMMUNICATION_CONVENTION, MEMORY_KEYS, OPTIMIZER_ASSUMPTION, TRANSIENT_NOTE
from lightning_nnscaler.parallelize import Plan

PLAN_KEY = "nnscaler"
"""The hyperparameter (and W&B config) key that holds the plan summary."""
CODE_FOLDER = "nnscaler_code"
"""Folder of a W&B run's files that holds the generated code (``<plan hash>/rank{r}.py``)."""


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


def plan_summary(plan: Plan) -> dict[str, Any]:
    """The plan as loggers take it: recipe and parameters, world size, plan hash, ZeRO stage and, per
    rank, ``Plan.memory_rows`` (the rows ``Plan.explain`` prints) as ``<key>_bytes``, with
    ``total_bytes`` their memory's sum; ``notes`` says what the optimizer and communication figures assume."""
    memory = {}
    for rank, row in enumerate(plan.memory_rows()):
        memory[f"rank{rank}"] = {**{f"{key}_bytes": value for key, value in row.items()}, "total_bytes": sum(row[key] for key in MEMORY_KEYS)}
    return {
        "recipe": plan.recipe,
        "recipe_params": dict(plan.params),
        "world_size": plan.world_size,
        "plan_hash": plan.plan_hash,
        "zero_stage": plan.zero_stage,
        "memory": memory,
        "notes": {"optimizer": OPTIMIZER_ASSUMPTION, "transient": TRANSIENT_NOTE, "communication": COMMUNICATION_CONVENTION},
    }


@rank_zero_only
def log_plan(loggers: Iterable[Logger], plan: Plan) -> None:
    """Log the plan (``plan_summary``, under the key ``PLAN_KEY``) to every logger; rank 0 only.

    A ``WandbLogger`` also gets the plan hash and each rank's total memory estimate in the run summary,
    and the generated code as ``CODE_FOLDER/<plan hash>/rank{r}.py`` among the run's files.
    """
    summary = plan_summary(plan)
    for logger in loggers:
        logger.log_hyperparams({PLAN_KEY: summary})
        if isinstance(logger, WandbLogger):
            run = logger.experiment
            totals = {f"{PLAN_KEY}/memory/{rank}/total_bytes": row["total_bytes"] for rank, row in summary["memory"].items()}
            run.summary.update({f"{PLAN_KEY}/plan_hash": plan.plan_hash, **totals})
            plan.save_code(Path(run.dir) / CODE_FOLDER)  # files in the run's folder are kept with the run
