"""Values a traced training_step would freeze: per-step values are refused at tracing, plain
attributes the step read are checked before every step, and tracing leaves the module as it was."""

from __future__ import annotations

import math
import pickle
import re
from typing import Any

import pytest
import torch
from torch import nn

import lightning_nnscaler as lnn
from lightning_nnscaler.capture.step_values import FrozenAttribute, FrozenValueError, StepValues
from lightning_nnscaler.capture.trace import bind_inputs, trace_step, trace_training_step
from lightning_nnscaler.ir.interpret import run_graph

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


def trainer_at(global_step: int, current_epoch: int) -> L.Trainer:
    """A Trainer whose ``global_step`` and ``current_epoch`` read as given (as in the middle of a fit)."""
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total.completed = global_step
    trainer.fit_loop.epoch_progress.current.completed = current_epoch
    assert (trainer.global_step, trainer.current_epoch) == (global_step, current_epoch)
    return trainer


@pytest.mark.parametrize(
    ("model_class", "guards", "lifted"),
    [
        (BranchesOnBatchIndex, ["bool(batch_idx % 2) -> True"], []),
        (BranchesOnGlobalStep, ["self.global_step > 3 -> False"], []),
        (ScalesByEpoch, [], ["current_epoch"]),
        (MakesTensorOfStep, ["float(self.global_step) -> 0.0"], []),
        (LooksUpByEpoch, ["hash(self.current_epoch) -> 0", "self.current_epoch == 0 -> True"], []),
        (ReadsTrainerStep, [], ["global_step"]),
        (WarmsUpWithTheNumberOnTheLeft, [], ["global_step"]),
        (DecaysByEpochPower, [], ["current_epoch"]),
        (ScalesByTwoToTheStep, [], ["global_step"]),
        (DividesByTheStep, [], ["batch_idx"]),
        (IndexesAScheduleList, ["self.current_epoch > 2 -> False", "index(self.current_epoch) -> 0"], []),
    ],
)
def test_arithmetic_on_per_step_values_is_lifted_and_decisions_are_guards(model_class: type, guards: list[str], lifted: list[str]) -> None:
    model = model_class()
    model.trainer = trainer_at(0, 0)
    step_values = trace_step(model, BATCH, batch_idx=1).step_values
    assert [str(guard).split(" (at ")[0] for guard in step_values.guards] == guards
    assert all(re.search(r"\(at .*test_step_values.py:\d+\)$", str(guard)) for guard in step_values.guards)
    assert [quantity for _, quantity in step_values.lifted] == lifted


@pytest.mark.parametrize(
    "model_class", [ScalesByEpoch, ReadsTrainerStep, WarmsUpWithTheNumberOnTheLeft, DecaysByEpochPower, ScalesByTwoToTheStep, DividesByTheStep]
)
def test_a_lifted_value_is_each_steps_own(model_class: type) -> None:
    """Traced at step 0 of epoch 0, the graph with its constants set to a later step's computes that step's loss."""
    model = model_class()
    model.trainer = trainer_at(0, 0)
    traced = trace_step(model, BATCH, batch_idx=0)
    first_loss = model.training_step(BATCH, 0)
    for batch_idx, global_step, current_epoch in [(3, 5, 2), (1, 11, 4)]:
        values = {"batch_idx": batch_idx, "global_step": global_step, "current_epoch": current_epoch}
        assert traced.step_values.failed_guard(values) is None
        for name, value in traced.step_values.constants(values).items():
            traced.graph.constant_values[name].fill_(value)
        loss = run_graph(traced.graph, bind_inputs(traced.graph, model, BATCH, step="training_step"))[traced.graph.outputs[0]]
        model.trainer = trainer_at(global_step, current_epoch)
        expected = model.training_step(BATCH, batch_idx)
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
        assert not torch.isclose(loss, first_loss), "the later step's factor differs from the traced one's"


def test_a_step_assigning_an_attribute_is_refused_naming_it_and_the_fix() -> None:
    model = CountsItsCalls()
    model.trainer = trainer_at(0, 0)
    with pytest.raises(FrozenValueError, match=r"assigns self.calls \(at .*\): the step's Python runs once.*on_train_batch_start") as error:
        lnn.trace(model, BATCH, step="training_step")
    assert isinstance(error.value, lnn.CaptureError)


def test_without_a_trainer_the_step_values_are_zero_and_still_watched() -> None:
    _, step_values = trace_training_step(BranchesOnGlobalStep(), BATCH)
    assert [str(guard).split(" (at ")[0] for guard in step_values.guards] == ["self.global_step > 3 -> False"]


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
    [(ReadsOnlyWhatDoesNotChange, None), (ScalesByEpoch, None), (CountsItsCalls, FrozenValueError), (Untraceable, lnn.CaptureError)],
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
