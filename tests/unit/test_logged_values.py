"""What ``training_step`` logs is computed by the plan, per data-parallel replica, as DDP computes it.

Each case plans a module that logs the loss, an accuracy, a perplexity (``exp(loss)``), a count
divided by ``len(y)`` (a number taken from the batch's shape), a ``log_dict`` and a constant, then
checks that ``plan.verify()`` passes (loss, gradients and the per-replica sums the ranks add up) and
that every replica's logged values equal the module's own ``training_step`` run eagerly on that
replica's rows — what a DDP rank would log.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import lightning_nnscaler as lnn
from lightning_nnscaler.capture import CaptureError
from lightning_nnscaler.logged_values import LoggedValueError

import lightning.pytorch as L  # noqa: E402 - after lightning_nnscaler

VOCAB, HIDDEN, ROWS, LENGTH = 32, 16, 8, 6


class LogsMetrics(L.LightningModule):
    """A small LM whose training_step logs the way the Lightning docs teach."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.ReLU(), nn.Linear(4 * HIDDEN, HIDDEN)) for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embedding(tokens)
        for layer in self.layers:
            hidden = hidden + layer(hidden)
        return self.head(hidden)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        logits = self(tokens)
        loss = F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))
        accuracy = (logits.argmax(-1) == targets).float().mean()
        self.log("train_loss", loss, sync_dist=True)
        self.log("train_acc", accuracy, prog_bar=True)
        self.log_dict({"perplexity": torch.exp(loss), "large_per_sample": (targets > 3).sum() / len(targets)}, on_epoch=True)
        self.log("constant", 3.0)
        return loss


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (ROWS, LENGTH), generator=generator), torch.randint(0, VOCAB, (ROWS, LENGTH), generator=generator)


def eager_logs(module: L.LightningModule, rows: tuple[torch.Tensor, ...]) -> list[tuple[str, Any, dict[str, Any]]]:
    """``(name, value, options)`` of each log call of ``module.training_step(rows, 0)`` run eagerly."""
    calls: list[tuple[str, Any, dict[str, Any]]] = []
    module.log = lambda name, value, **options: calls.append((name, value, options))  # type: ignore[method-assign]
    module.log_dict = lambda values, **options: calls.extend((name, value, options) for name, value in values.items())  # type: ignore[method-assign]
    try:
        with torch.no_grad():
            module.training_step(rows, 0)
    finally:
        del module.log, module.log_dict
    return calls


CASES = [
    ("dp", 4, {}), ("zero3", 4, {}), ("tp", 2, {}), ("sp", 2, {}), ("coshard", 2, {}), ("hybrid", 4, {"dp": 2, "tp": 2}),
    ("1f1b", 2, {}), ("gpipe", 4, {"stages": 2}),
]


@pytest.mark.parametrize(("recipe", "world_size", "params"), CASES, ids=[f"{recipe}{size}" for recipe, size, _ in CASES])
def test_each_replica_logs_what_its_own_training_step_computes(recipe: str, world_size: int, params: dict[str, int]) -> None:
    torch.manual_seed(0)
    module = LogsMetrics()
    tokens, targets = batch()
    plan = lnn.parallelize(module, (tokens, targets), recipe, world_size, step="training_step", **params)
    report = plan.verify()
    replicas = plan.data_layout.data_parallel
    rows = ROWS // replicas
    for replica in range(replicas):
        logged = plan.logged.logs(report.values, replica)
        expected = eager_logs(module, (tokens[replica * rows : (replica + 1) * rows], targets[replica * rows : (replica + 1) * rows]))
        assert [(name, options) for name, _, options in logged] == [(name, options) for name, _, options in expected]
        for (name, value, _), (_, wanted, _) in zip(logged, expected):
            assert float(value) == pytest.approx(float(wanted), rel=1e-5), f"{recipe}: replica {replica} logs {name}={float(value)}, its step {float(wanted)}"


def test_the_tail_runs_after_the_step_and_only_the_sums_stay_in_the_graph() -> None:
    torch.manual_seed(0)
    plan = lnn.parallelize(LogsMetrics(), batch(), "dp", 4, step="training_step")
    targets = {op.target for op in plan.graph.ops}
    assert "aten.exp.default" not in targets  # the perplexity's exp runs per replica after the step, on 4 numbers
    assert [op.target for op in plan.logged.tail].count("aten.exp.default") == 1
    assert all(plan.graph.tensors[name].shape == (4, 1) for name in plan.graph.outputs[1:])  # one sum per replica
    assert "VALUES = {" in plan.sources[0] and "VALUE_PIECES = [" in plan.sources[0]


class LogsMaximum(LogsMetrics):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self(batch[0])
        self.log("largest_logit", logits.max())
        return F.cross_entropy(logits.view(-1, VOCAB), batch[1].view(-1))


class LogsPerSample(LogsMetrics):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self(batch[0])
        self.log("per_sample", logits.mean(-1).mean(-1))
        return F.cross_entropy(logits.view(-1, VOCAB), batch[1].view(-1))


class LogsStepNumber(LogsMetrics):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.log("batch", batch_idx)
        return F.cross_entropy(self(batch[0]).view(-1, VOCAB), batch[1].view(-1))


class LogsMetricObject(LogsMetrics):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.log("metric", object())
        return F.cross_entropy(self(batch[0]).view(-1, VOCAB), batch[1].view(-1))


@pytest.mark.parametrize(
    ("module_class", "error", "message"),
    [
        (LogsMaximum, LoggedValueError, r"logs 'largest_logit', which reduces over the batch with op .*aten.max"),
        (LogsPerSample, CaptureError, r"logs 'per_sample', a tensor of shape \(8,\)"),
        (LogsMetricObject, CaptureError, r"logs 'metric' = a object.*instead of a Metric object"),
    ],
)
def test_what_cannot_be_logged_per_replica_is_refused_naming_the_key(module_class: type, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        lnn.parallelize(module_class(), batch(), "dp", 2, step="training_step")


def test_a_logged_step_number_is_computed_by_the_plan_every_step() -> None:
    plan = lnn.parallelize(LogsStepNumber(), batch(), "dp", 2, step="training_step", batch_idx=5)
    plan.verify()
    assert [quantity for _, quantity in plan.step_values.lifted] == ["batch_idx"]
    assert plan.step_values.constants({"batch_idx": 7, "global_step": 0, "current_epoch": 0}) == {plan.step_values.lifted[0][0]: 7}


def test_a_value_that_does_not_depend_on_the_batch_is_computed_whole() -> None:
    class LogsWeightNorm(LogsMetrics):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.log("head_norm", self.head.weight.norm())
            return F.cross_entropy(self(batch[0]).view(-1, VOCAB), batch[1].view(-1))

    torch.manual_seed(0)
    module = LogsWeightNorm()
    plan = lnn.parallelize(module, batch(), "dp", 2, step="training_step")
    report = plan.verify()
    for replica in range(2):
        ((name, value, _),) = plan.logged.logs(report.values, replica)
        assert name == "head_norm" and float(value) == pytest.approx(float(module.head.weight.norm().detach()), rel=1e-6)


def test_a_metric_computed_in_the_step_is_replayed_after_it_not_frozen() -> None:
    import torchmetrics

    class ComputesAccuracy(LogsMetrics):
        def __init__(self) -> None:
            super().__init__()
            self.accuracy = torchmetrics.classification.Accuracy(task="multiclass", num_classes=VOCAB)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            logits = self(batch[0]).view(-1, VOCAB)
            self.accuracy.update(logits, batch[1].view(-1))
            self.log("accuracy_so_far", self.accuracy.compute())
            return F.cross_entropy(logits, batch[1].view(-1))

    module = ComputesAccuracy()
    plan = lnn.parallelize(module, batch(), "dp", 2, step="training_step")
    assert [call.method for call in plan.logged.metric_calls] == ["update", "compute"]
    assert int(module.accuracy.tp.sum() + module.accuracy.fn.sum()) == 0  # tracing updated nothing
    report = plan.verify()
    tokens, targets = batch()
    rows = len(tokens) // 2
    for step in range(1, 3):  # each replay updates the real metric: the logged value is computed from its state then
        ((name, value, _),) = plan.logged.logs(report.values, 0, module)
        assert int(module.accuracy.tp.sum() + module.accuracy.fn.sum()) == step * targets[:rows].numel()
        eager = torchmetrics.classification.Accuracy(task="multiclass", num_classes=VOCAB)
        for _ in range(step):
            eager.update(module(tokens[:rows]).view(-1, VOCAB), targets[:rows].view(-1))
        assert name == "accuracy_so_far" and float(value) == pytest.approx(float(eager.compute()), rel=1e-6)


def test_a_metric_value_used_in_the_loss_math_is_refused_naming_the_fix() -> None:
    import torchmetrics

    class WeighsByAccuracy(LogsMetrics):
        def __init__(self) -> None:
            super().__init__()
            self.accuracy = torchmetrics.classification.Accuracy(task="multiclass", num_classes=VOCAB)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            logits = self(batch[0]).view(-1, VOCAB)
            return F.cross_entropy(logits, batch[1].view(-1)) * (1 - self.accuracy(logits, batch[1].view(-1)))

    with pytest.raises(CaptureError, match=r"uses the value a torchmetrics Metric's call returned .* Log it"):
        lnn.parallelize(WeighsByAccuracy(), batch(), "dp", 2, step="training_step")
