"""Evaluation through the plan: ``validation_step``, ``test_step`` and ``predict_step`` planned forward-only over the
training pieces.

An evaluation step is traced on its first batch of each shape like ``training_step`` (``capture.trace``'s
evaluation steps), planned with the training recipe, and run by an executor over the training plan's
own parameter and buffer pieces (``RankExecutor.sharing_pieces``): no backward, no optimizer, no full
module. What the step logs is computed per data-parallel replica, as in training. A step the plan
cannot run (one that returns more than a number, uses a submodule training does not, or plans to other
pieces) runs on the full LightningModule instead, and the strategy says so once.

``predict_step`` returns tensors with one row per sample (logits), or tuples, lists and dicts of them. While it
is planned, its prediction is handed to `PredictionRows`, a torchmetrics ``Metric`` the module holds for the
trace only: like any tensor a step passes to a metric, each becomes an output of the plan made whole on every
rank, of which each rank takes its data-parallel replica's rows (``logged_values``' per-row outputs). So every
rank gets its own batch's predictions, as under ddp.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from torch.utils import _pytree as pytree
from torchmetrics import Metric

from lightning_nnscaler.capture.convert import CaptureError
from lightning_nnscaler.plan import Plan
from lightning_nnscaler.runtime.executor import RankExecutor
from lightning_nnscaler.strategy.planning import batch_signature

EVALUATION_CONTEXTS = {"validation_step": "val_step_context", "test_step": "test_step_context", "predict_step": "predict_step_context"}
"""The precision plugin's context each evaluation step runs in (as Lightning's strategies use them)."""

PREDICTION_METRIC = "nnscaler_prediction_rows"
"""Where `PredictionRows` sits in the module while ``predict_step`` is planned."""


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


@dataclass(frozen=True)
class EvaluationPlan:
    """An evaluation step's plan, the executor running it over this rank's pieces, and for ``predict_step`` where its
    prediction comes out."""

    plan: Plan
    executor: RankExecutor
    prediction: Optional[PlannedPrediction] = None


@dataclass(frozen=True)
class PlannedPrediction:
    """Where a planned ``predict_step``'s prediction comes out: graph outputs, whole, and how to rebuild its structure."""

    outputs: tuple[str, ...]
    """The graph output of each tensor of the prediction (``pytree`` leaf order)."""
    structure: pytree.TreeSpec

    def of_replica(self, plan: Plan, executor: RankExecutor, replica: int) -> Any:
        """The prediction of replica ``replica``'s rows, from the outputs the executor summed over the ranks (released
        after: they are the whole batch's, in float64)."""
        assert plan.logged is not None
        tensors = []
        for name in self.outputs:
            dim, dtype = plan.logged.per_row[name]
            whole = executor.values[name]
            rows = whole.shape[dim] // plan.logged.replicas
            tensors.append(whole.narrow(dim, replica * rows, rows).to(dtype))
        executor.values = {}
        return pytree.tree_unflatten(tensors, self.structure)


class PredictionRows(Metric):
    """Takes ``predict_step``'s tensors while the step is traced (the trace records the call; it never runs)."""

    def update(self, *tensors: torch.Tensor) -> None:
        """Nothing: the recorded call makes ``tensors`` outputs of the plan."""

    def compute(self) -> None:
        """Nothing to compute."""


@dataclass
class _TracedPrediction:
    """What tracing ``predict_step`` saw: the structure its tensors are returned in."""

    structure: Optional[pytree.TreeSpec] = None


@contextlib.contextmanager
def planning_step(module: torch.nn.Module, step: str) -> Iterator[Optional[_TracedPrediction]]:
    """Inside, ``step`` is ready to be planned: for ``predict_step`` the module's step hands its prediction to a
    `PredictionRows` it holds meanwhile (both undone after); other steps as they are (yields None)."""
    if step != "predict_step":
        yield None
        return
    traced = _TracedPrediction()
    user_step, own = module.predict_step, module.__dict__.get("predict_step")

    def predict_step(*args: Any, **kwargs: Any) -> torch.Tensor:
        tensors, structure = pytree.tree_flatten(user_step(*args, **kwargs))
        others = [type(leaf).__name__ for leaf in tensors if not isinstance(leaf, torch.Tensor)]
        if not tensors or others:
            returned = others[0] if others else "no tensor"
            raise CaptureError(f"predict_step returns {returned}: a plan returns tensors, or tuples, lists and dicts of them")
        traced.structure = structure
        getattr(module, PREDICTION_METRIC)(*tensors)
        return tensors[0].float().sum()  # output 0, a number: a plan's first output is summed over the ranks like a loss

    module.add_module(PREDICTION_METRIC, PredictionRows())
    module.predict_step = predict_step
    try:
        yield traced
    finally:
        del module._modules[PREDICTION_METRIC]
        if own is None:
            del module.predict_step
        else:
            module.predict_step = own


def planned_prediction(plan: Plan, traced: _TracedPrediction) -> PlannedPrediction:
    """Where ``plan`` (of ``predict_step``, planned inside `planning_step`) puts the prediction; takes the stand-in
    metric call out of the plan, so nothing replays it.

    Raises:
        ValueError: a tensor of the prediction has no row per sample, so no rank could take its own rows.
    """
    logged = plan.logged
    assert logged is not None and traced.structure is not None
    calls = [call for call in logged.metric_calls if call.path == PREDICTION_METRIC]
    logged.metric_calls = [call for call in logged.metric_calls if call.path != PREDICTION_METRIC]
    outputs = tuple(logged.step_outputs[position] for call in calls[-1:] for _, position in call.arguments)
    whole = [name for name in outputs if name not in logged.per_row]
    if whole:
        raise ValueError(
            f"predict_step returns a tensor without a row per sample (output %{whole[0]}): the plan gives each rank its "
            "replica's rows of what predict_step returns; return per-sample tensors such as logits (B, ...)"
        )
    return PlannedPrediction(outputs, traced.structure)


def release_gradients(executor: RankExecutor, module: torch.nn.Module) -> None:
    """Drop the gradients of ``executor``'s pieces that are not ``module``'s own tensors: after a fit no one reads them
    (a next fit plans anew), so evaluation does not hold them beside its own activations."""
    own = {id(parameter) for parameter in module.parameters()}
    for tensor in [*(shard.tensor for shard in executor.shards.values()), *(piece.tensor for piece in executor.pieces())]:
        if id(tensor) not in own:
            tensor.grad = None


def forward_only(executor: RankExecutor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """This rank's part of the plan's forward (no backward, no optimizer); returns the whole first output.

    Under ZeRO-3 the boxes are gathered from their chunks for it and released after, as for a training step: stage by
    stage where the program gathers the reducer's buckets itself (``RankExecutor.gathers_by_program``), else all at once.
    """
    zero3 = executor.reducer.zero_stage == 3
    if zero3 and not executor.gathers_by_program:
        executor.reducer.gather_boxes()
    try:
        return executor.forward_backward(inputs, backward=False)
    finally:
        if zero3:
            executor.reducer.release_boxes()
