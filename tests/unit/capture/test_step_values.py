"""Values a traced training_step would freeze: per-step values are refused at tracing, plain
attributes the step read are checked before every step, and tracing leaves the module as it was."""

from __future__ import annotations

import math
import pickle
from typing import Any

import pytest
import torch
from torch import nn

import lightning_nnscaler as lnn
from lightning_nnscaler.capture.step_values import FrozenAttribute, FrozenValueError, StepValues
from lightning_nnscaler.capture.trace import trace_training_step

import lightning as L  # noqa: E402 - after lightning_nnscaler

BATCH = (torch.randn(8, 4), torch.randn(8))


class Regression(L.LightningModule):
    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.encoder = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.0), nn.Linear(8, 1))
        self.calls = 0
        self.weight_decay_name = "none"

    def loss(self, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        return ((self.encoder(inputs).squeeze(-1) - targets) ** 2).mean()


class BranchesOnBatchIndex(Regression):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        if batch_idx % 2:
            loss = loss * 2
        return loss


class BranchesOnGlobalStep(Regression):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        if self.global_step > 3:
            loss = loss * 2
        return loss


class ScalesByEpoch(Regression):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(batch) * self.current_epoch  # Tensor.__mul__ reads the int in C: seen by the torch-call watch


class MakesTensorOfStep(Regression):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(batch) + torch.tensor(float(self.global_step)) * 0


class LooksUpByEpoch(Regression):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(batch) * {0: 1.0, 1: 0.5}.get(self.current_epoch, 0.1)


class ReadsTrainerStep(Regression):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(batch) * (1 + self.trainer.global_step)


class CountsItsCalls(Regression):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.calls += 1
        return self.loss(batch)


class WarmsUpWithTheNumberOnTheLeft(Regression):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(batch) * (0.5 * self.global_step + 1.0)


class DecaysByEpochPower(Regression):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(batch) * 0.9**self.current_epoch


class ScalesByTwoToTheStep(Regression):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(batch) * 2.0**self.trainer.global_step


class DividesByTheStep(Regression):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(batch) * (1.0 / (1.0 + batch_idx))


class IndexesAScheduleList(Regression):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(batch) * [1.0, 0.5, 0.25][min(self.current_epoch, 2)]


@pytest.mark.parametrize(
    ("model_class", "message"),
    [
        (WarmsUpWithTheNumberOnTheLeft, r"computes with self.global_step \(at .*test_step_values.py:\d+\)"),
        (DecaysByEpochPower, r"computes with self.current_epoch"),
        (ScalesByTwoToTheStep, r"computes with self.trainer.global_step"),
        (DividesByTheStep, r"computes with batch_idx"),
        (IndexesAScheduleList, r"computes with self.current_epoch"),
        (BranchesOnBatchIndex, r"BranchesOnBatchIndex.training_step computes with batch_idx \(at .*test_step_values.py:\d+\)"),
        (BranchesOnGlobalStep, r"computes with self.global_step \(at .*test_step_values.py:\d+\)"),
        (ScalesByEpoch, r"computes with self.current_epoch"),
        (MakesTensorOfStep, r"computes with self.global_step"),
        (LooksUpByEpoch, r"computes with self.current_epoch"),
        (ReadsTrainerStep, r"computes with self.trainer.global_step"),
        (CountsItsCalls, r"assigns self.calls \(at .*\): the step's Python runs once.*on_train_batch_start"),
    ],
)
def test_a_step_computing_with_a_per_step_value_is_refused_naming_it_and_the_fix(model_class: type, message: str) -> None:
    model = model_class()
    model.trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(FrozenValueError, match=message) as error:
        lnn.trace(model, BATCH, step="training_step")
    assert isinstance(error.value, lnn.CaptureError)
    if "assigns" not in message:
        assert "pass it in as a tensor of the batch" in str(error.value) and "torch.where" in str(error.value)


def test_without_a_trainer_the_step_values_are_zero_and_still_watched() -> None:
    with pytest.raises(FrozenValueError, match="self.global_step"):
        trace_training_step(BranchesOnGlobalStep(), BATCH)


class BranchesOnCounter(Regression):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        if self.calls > 0:  # `calls` changes in a hook between steps
            loss = loss * 2
        return loss


def test_a_counter_attribute_the_step_read_is_checked_before_each_step() -> None:
    model = BranchesOnCounter()
    _, step_values = trace_training_step(model, BATCH)
    assert FrozenAttribute("", "calls", 0, step_values.attributes[-1].location) in step_values.attributes
    step_values.check(model)
    model.calls += 1  # what on_train_batch_start would do
    with pytest.raises(FrozenValueError, match=r"read self.calls \(at .*\), which was 0 when the step was traced and is 1 now"):
        step_values.check(model)


def test_a_submodule_attribute_the_step_read_is_checked_by_its_path() -> None:
    model = BranchesOnCounter()
    _, step_values = trace_training_step(model, BATCH)
    model.encoder[1].p = 0.5  # a dropout schedule changing p in a hook
    with pytest.raises(FrozenValueError, match=r"read self.encoder.1.p .*was 0.0 when the step was traced and is 0.5 now"):
        step_values.check(model)


class BranchesOnPrivateCounter(Regression):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        # `automatic_optimization` is a property over Lightning's private `_automatic_optimization`
        return self.loss(batch) * (2 if self._warm and self.automatic_optimization else 1)


def test_a_private_attribute_of_the_user_is_checked_and_lightnings_are_not() -> None:
    model = BranchesOnPrivateCounter()
    model._warm = False
    _, step_values = trace_training_step(model, BATCH)
    assert [attribute.label for attribute in step_values.attributes if attribute.path == ""] == ["self._warm"]
    model._warm = True
    with pytest.raises(FrozenValueError, match=r"read self._warm .*was False when the step was traced and is True now"):
        step_values.check(model)


class ReadsOnlyWhatDoesNotChange(Regression):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch) * self.hparams.scale
        self.log(f"loss_{batch_idx}_{self.global_step}", loss)  # formatting a step value is no use
        if self.training and self.weight_decay_name == "none":
            loss = loss + 0.0
        return loss


def test_reading_training_hparams_and_constants_passes_every_check() -> None:
    model = ReadsOnlyWhatDoesNotChange(scale=2.0)
    graph, step_values = trace_training_step(model, BATCH)
    assert graph.ops
    assert {attribute.label for attribute in step_values.attributes} == {"self.weight_decay_name", "self.encoder.1.p", "self.encoder.1.inplace"}
    for fx_name in ("training_step", "on_train_batch_end", "validation_step"):
        model._current_fx_name = fx_name  # Lightning's own state changes between steps
        model.train(fx_name != "validation_step")  # and so does `training`, around validation
        model.hparams.scale = 2.0
        step_values.check(model)


def test_check_compares_type_and_value() -> None:
    model = Regression()
    model.flag, model.rate = True, math.nan
    step_values = StepValues((FrozenAttribute("", "flag", True, "here"), FrozenAttribute("", "rate", math.nan, "here")))
    step_values.check(model)  # NaN equals NaN
    model.flag = 1  # equal to True, but not the traced value's type
    with pytest.raises(FrozenValueError, match=r"self.flag .*was True when the step was traced and is 1 now"):
        step_values.check(model)
    del model.flag
    with pytest.raises(FrozenValueError, match=r"is '<deleted>' now"):
        step_values.check(model)


class Untraceable(Regression):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        if loss.item() > 0:  # Python control flow on a tensor value
            loss = loss * 2
        return loss


@pytest.mark.parametrize(
    ("model_class", "error"),
    [(ReadsOnlyWhatDoesNotChange, None), (ScalesByEpoch, FrozenValueError), (CountsItsCalls, FrozenValueError), (Untraceable, lnn.CaptureError)],
)
def test_tracing_restores_the_classes_and_attributes_also_when_it_fails(model_class: type, error: type | None) -> None:
    model = model_class()
    model.trainer = trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    classes = {name: type(module) for name, module in model.named_modules()}
    attributes = {name: dict(vars(module)) for name, module in model.named_modules()}
    if error is None:
        trace_training_step(model, BATCH)
    else:
        with pytest.raises(error):
            trace_training_step(model, BATCH)
    assert {name: type(module) for name, module in model.named_modules()} == classes
    assert type(model) is model_class and type(trainer) is L.Trainer
    assert {name: dict(vars(module)) for name, module in model.named_modules()} == attributes
    assert type(model.global_step) is int and type(model.current_epoch) is int
    model.trainer = None
    pickle.dumps(model)  # no watched class is left behind
