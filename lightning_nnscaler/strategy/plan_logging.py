"""What ``NnScalerStrategy`` logs about the plan it runs (what ``training_step`` logs is computed by the
plan itself: ``lightning_nnscaler.logged_values``).

**The plan** (``log_plan``, once per fit, when the first batch was planned): every logger's
``log_hyperparams`` gets the plan summary (recipe and parameters, world size, plan hash, and per
rank the very rows ``Plan.explain`` prints: memory estimate and bytes sent per step); a ``WandbLogger`` also gets it in the run summary, with the generated per-rank
code saved among the run's files. With them, the predicted step (``step_timing.predict_step``):
``nnscaler/predicted_step_ms`` and the spec it was predicted on, ``nnscaler/predicted_spec``.

**The search** (``recipe="auto"``): the plan summary's ``search`` holds the chosen recipe and its
parameters (``chosen_recipe``, ``chosen_params``), its predicted step and peak memory, and the ranked
candidates (``search_summary``); rank 0 also prints the winner and the ranked table to the console.

**The measured step** (``log_measured_step``, at the end of the fit): ``nnscaler/measured_step_ms``
(``step_timing.StepTimer``'s median) and ``nnscaler/measured_over_predicted`` go to every logger's
``log_metrics`` (and so to a W&B run's summary).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch.loggers import Logger, WandbLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only

from lightning_nnscaler.explain import COMMUNICATION_CONVENTION, MEMORY_KEYS, OPTIMIZER_ASSUMPTION, TRANSIENT_NOTE
from lightning_nnscaler.plan import Plan
from lightning_nnscaler.strategy.step_timing import PredictedStep

if TYPE_CHECKING:  # the simulator is imported only where a plan is searched or predicted
    from lightning_nnscaler.sim.search import Outcome, SearchResult

PLAN_KEY = "nnscaler"
"""The hyperparameter (and W&B config) key that holds the plan summary."""
CODE_FOLDER = "nnscaler_code"
"""Folder of a W&B run's files that holds the generated code (``<plan hash>/rank{r}.py``)."""
PREDICTED_STEP_KEY = f"{PLAN_KEY}/predicted_step_ms"
PREDICTED_SPEC_KEY = f"{PLAN_KEY}/predicted_spec"
MEASURED_STEP_KEY = f"{PLAN_KEY}/measured_step_ms"
MEASURED_OVER_PREDICTED_KEY = f"{PLAN_KEY}/measured_over_predicted"
SEARCH_ROWS = 20
"""Candidates of an ``auto`` search that the console and the loggers get, fastest first (the count of all is logged too)."""


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
        **({"search": search_summary(plan.search)} if plan.search is not None else {}),
    }


def search_summary(search: SearchResult) -> dict[str, Any]:
    """What ``recipe="auto"`` chose and measured: the winner's recipe and parameters, its predicted step (ms) and
    peak memory (bytes per rank) on the spec, and the first ``SEARCH_ROWS`` candidates in rank order."""
    best = search.best
    return {
        "chosen_recipe": best.candidate.recipe,
        "chosen_params": best.candidate.kwargs,
        "predicted_step_ms": _milliseconds(best),
        "peak_bytes": best.peak_bytes,
        "spec": search.spec_name,
        "memory_limit_bytes": int(search.memory_limit_bytes),
        "candidates_searched": len(search.outcomes),
        "candidates_fitting": len(search.ranked),
        "ranked": [
            {"candidate": str(outcome.candidate), "predicted_step_ms": _milliseconds(outcome), "peak_bytes": outcome.peak_bytes,
             "fits": outcome.reason or "yes"}
            for outcome in search.outcomes[:SEARCH_ROWS]
        ],
    }


def _milliseconds(outcome: Outcome) -> float | None:
    return None if outcome.step_seconds is None else outcome.step_seconds * 1e3


def predicted_values(predicted: PredictedStep | None) -> dict[str, Any]:
    """``{PREDICTED_STEP_KEY: ms, PREDICTED_SPEC_KEY: the spec's device}`` (and why that spec, when it is
    not the device's own); nothing when there is no prediction."""
    if predicted is None:
        return {}
    spec = predicted.spec_name + (f" ({predicted.note})" if predicted.note else "")
    return {PREDICTED_STEP_KEY: predicted.step_seconds * 1e3, PREDICTED_SPEC_KEY: spec}


@rank_zero_only
def log_plan(loggers: Iterable[Logger], plan: Plan, predicted: PredictedStep | None = None) -> None:
    """Log the plan (``plan_summary``, under the key ``PLAN_KEY``) and its ``predicted`` step
    (``predicted_values``) to every logger; rank 0 only. For ``recipe="auto"`` it first prints the search's
    winner and ranked table (``SEARCH_ROWS`` rows) to the console.

    A ``WandbLogger`` also gets the plan hash, each rank's total memory estimate and the predicted step
    in the run summary, and the generated code as ``CODE_FOLDER/<plan hash>/rank{r}.py`` among the run's files.
    """
    if plan.search is not None:
        rank_zero_info(f"NnScalerStrategy: recipe 'auto' chose {plan.search.best.candidate}\n{plan.search.summary()}\n"
                       f"{plan.search.table(SEARCH_ROWS)}")
    summary = plan_summary(plan)
    prediction = predicted_values(predicted)
    for logger in loggers:
        logger.log_hyperparams({PLAN_KEY: summary, **prediction})
        if isinstance(logger, WandbLogger):
            run = logger.experiment
            totals = {f"{PLAN_KEY}/memory/{rank}/total_bytes": row["total_bytes"] for rank, row in summary["memory"].items()}
            run.summary.update({f"{PLAN_KEY}/plan_hash": plan.plan_hash, **totals, **prediction})
            plan.save_code(Path(run.dir) / CODE_FOLDER)  # files in the run's folder are kept with the run


@rank_zero_only
def log_measured_step(loggers: Iterable[Logger], measured_seconds: float, predicted: PredictedStep | None, step: int) -> None:
    """Log the fit's measured step (``MEASURED_STEP_KEY``, ms) and, with a prediction, measured / predicted
    (``MEASURED_OVER_PREDICTED_KEY``) as metrics at ``step`` to each ``WandbLogger``; rank 0 only. Other
    loggers (CSV, TensorBoard) get no extra row: their metrics stay exactly what ``ddp`` would write."""
    metrics = {MEASURED_STEP_KEY: measured_seconds * 1e3}
    if predicted is not None and predicted.step_seconds > 0:
        metrics[MEASURED_OVER_PREDICTED_KEY] = measured_seconds / predicted.step_seconds
    for logger in loggers:
        if isinstance(logger, WandbLogger):
            logger.log_metrics(metrics, step=step)
