"""NnScalerStrategy never trains a frozen Python value silently: a step that computes with
``self.global_step`` / ``batch_idx`` trains like ``strategy="auto"`` (arithmetic lifted into the plan,
decisions planned once per outcome, logging every N batches included), a decision that changes every
step is refused after a few plans, and a plain attribute the step read that changes is refused at the
step where it changes.

One device: the run joins a 1-rank gloo group in the pytest process; the fixture leaves it and
restores the environment variables Lightning set.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_nnscaler import NnScalerStrategy
from lightning_nnscaler.capture.step_values import FrozenValueError

import lightning as L  # noqa: E402 - after lightning_nnscaler
from lightning.pytorch.callbacks import Callback  # noqa: E402

BATCH_SIZE, BATCHES_PER_EPOCH, EPOCHS = 4, 2, 2


class Regression(L.LightningModule):
    """A small MLP regression trained with SGD; the same initial weights every time."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mlp = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.calls = 0
        self.loss_name = "mse"

    def loss(self, batch: Any) -> torch.Tensor:
        inputs, targets = batch[0], batch[1]
        return ((self.mlp(inputs).squeeze(-1) - targets) ** 2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class BranchesOnGlobalStep(Regression):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        return loss * 2 if self.global_step > 3 else loss


class BranchesOnBatchIndex(Regression):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        return loss * 2 if batch_idx % 2 else loss


class CounterChangedInAHook(Regression):
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.calls += 1

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        return loss * 2 if self.calls > 1 else loss


class EpochAsABatchTensor(Regression):
    """The fix: the epoch comes in as a tensor of the batch, and the step reads only constants."""

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        inputs, targets = batch
        return inputs, targets, torch.full((len(inputs),), float(self.current_epoch))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        epoch = batch[2].mean()
        weighted = loss * (1 + epoch)  # (1 + epoch) grows every epoch
        return torch.where(epoch > 0, weighted, loss) if self.training and self.loss_name == "mse" else loss


class LossRecorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


def _fit(model: L.LightningModule, strategy: Any, epochs: int = EPOCHS) -> tuple[L.Trainer, list[float]]:
    generator = torch.Generator().manual_seed(1)
    samples = BATCH_SIZE * BATCHES_PER_EPOCH
    data = TensorDataset(torch.randn(samples, 4, generator=generator), torch.randn(samples, generator=generator))
    recorder = LossRecorder()
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=[recorder],
    )
    # Lightning keeps a DistributedSampler it is given: both strategies see the same order every epoch.
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    trainer.fit(model, DataLoader(data, batch_size=BATCH_SIZE, sampler=sampler, drop_last=True))
    return trainer, recorder.losses


class WarmsUp(Regression):
    """The Lightning docs' warm-up, written with the numbers on the left."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        warm_up = min(1.0, (self.trainer.global_step + 1) / 4.0)
        return self.loss(batch) * warm_up * 0.9**self.current_epoch + 0.01 * self.global_step


class LogsEveryOtherBatch(Regression):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        if batch_idx % 2 == 0:
            self.log("sampled_loss", loss * 10)
        self.log("step", self.global_step)
        return loss


class RecordsLogged(Callback):
    def __init__(self) -> None:
        self.logged: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.logged.append({key: float(value) for key, value in trainer.callback_metrics.items()})


class RebuildsAStepTensor(Regression):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(batch) * torch.full((), float(self.global_step) + 1.0)  # float(): a decision per step


@pytest.mark.timeout(180)
@pytest.mark.parametrize("model_class", [BranchesOnGlobalStep, BranchesOnBatchIndex, WarmsUp])
def test_a_step_computing_with_per_step_values_trains_like_auto(one_rank_group: None, model_class: type) -> None:
    _, expected = _fit(model_class(), "auto", epochs=3)
    trainer, losses = _fit(model_class(), NnScalerStrategy(), epochs=3)
    assert len(losses) == BATCHES_PER_EPOCH * 3
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-7)
    plans = [plan for variants in trainer.strategy._plans_by_shape.values() for plan, _ in variants]
    assert len(plans) == {BranchesOnGlobalStep: 2, BranchesOnBatchIndex: 2, WarmsUp: 2}[model_class]  # one per outcome (warm-up ends)


@pytest.mark.timeout(180)
def test_logging_every_other_batch_logs_what_auto_logs(one_rank_group: None) -> None:
    logged = []
    for strategy in ("auto", NnScalerStrategy()):
        recorder = RecordsLogged()
        model = LogsEveryOtherBatch()
        model.configure_callbacks = lambda recorder=recorder: [recorder]
        _fit(model, strategy)
        logged.append(recorder.logged)
    expected, ours = logged
    assert [sorted(entry) for entry in ours] == [sorted(entry) for entry in expected]
    assert [entry["step"] for entry in ours] == [0.0, 1.0, 2.0, 3.0]
    for mine, theirs in zip(ours, expected):
        torch.testing.assert_close(torch.tensor(list(mine.values())), torch.tensor([theirs[key] for key in mine]), rtol=1e-5, atol=1e-7)


@pytest.mark.timeout(240)
def test_a_decision_that_changes_every_step_is_refused_after_a_few_plans(one_rank_group: None) -> None:
    model = RebuildsAStepTensor()
    with pytest.raises(FrozenValueError, match=r"decides differently on per-step values at its 9th outcome \(float\(self.global_step\) -> .* \(at .*test_strategy_step_values.py:\d+\)"):
        _fit(model, NnScalerStrategy(), epochs=5)
    assert model.trainer.global_step == 8  # eight steps trained, each with its own (correct) plan


@pytest.mark.timeout(120)
def test_an_attribute_the_step_read_is_refused_at_the_step_where_it_changes(one_rank_group: None) -> None:
    model = CounterChangedInAHook()
    with pytest.raises(FrozenValueError, match=r"read self.calls \(at .*\), which was 1 when the step was traced and is 2 now"):
        _fit(model, NnScalerStrategy())
    assert model.trainer.global_step == 1  # the first step trained (calls == 1, as traced); the second was refused


@pytest.mark.timeout(120)
def test_a_step_given_the_epoch_as_a_tensor_trains_like_auto(one_rank_group: None) -> None:
    _, expected = _fit(EpochAsABatchTensor(), "auto")
    trainer, losses = _fit(EpochAsABatchTensor(), NnScalerStrategy())
    assert len(losses) == BATCHES_PER_EPOCH * EPOCHS and trainer.current_epoch == EPOCHS
    assert {attribute.label for attribute in trainer.strategy.plan.step_values.attributes} == {"self.loss_name"}
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-7)


class LogsItems(Regression):
    """The Lightning docs' habit: log Python numbers taken with ``.item()``."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("loss_item", loss.item())
        self.log("bias_item", self.mlp[2].bias[0].item(), on_step=True)
        return loss


class MetricRecorder(Callback):
    def __init__(self) -> None:
        self.values: list[tuple[float, float]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        metrics = trainer.callback_metrics
        self.values.append((float(metrics["loss_item"]), float(metrics["bias_item"])))


@pytest.mark.timeout(120)
def test_numbers_logged_with_item_are_each_steps_values_as_under_auto(one_rank_group: None) -> None:
    logged = {}
    for strategy in ("auto", NnScalerStrategy()):
        recorder = MetricRecorder()
        model = LogsItems()
        model.configure_callbacks = lambda recorder=recorder: [recorder]
        _, losses = _fit(model, strategy)
        logged[str(strategy)] = (losses, recorder.values)
    (expected_losses, expected), (losses, values) = logged.values()
    assert len(values) == BATCHES_PER_EPOCH * EPOCHS and len({bias for _, bias in values}) == len(values)  # a new value every step
    torch.testing.assert_close(torch.tensor(values), torch.tensor(expected), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-5, atol=1e-7)
