"""The strategy's predicted and measured step: which spec a device gets, a simulator failure that only
warns, and which optimizer steps the measured median is over."""

from __future__ import annotations

import pytest
import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.sim import predict, spec_for_device
from lightning_nnscaler.strategy.plan_logging import PREDICTED_SPEC_KEY, PREDICTED_STEP_KEY, predicted_values
from lightning_nnscaler.strategy.step_timing import MEASURED_AFTER, StepTimer, predict_step


@pytest.mark.parametrize(
    ("device", "spec"),
    [("cpu", "cpu"), ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA A100-SXM4-40GB", "a100"), ("NVIDIA H200", "h200"), ("Tesla V100-SXM2-16GB", "v100")],
)
def test_a_device_gets_its_shipped_spec(device: str, spec: str) -> None:
    assert spec_for_device(device) == (spec, "")


def test_a_gpu_without_a_shipped_spec_is_predicted_on_a100_and_says_so() -> None:
    assert spec_for_device("NVIDIA RTX A1000") == ("a100", "no shipped spec matches 'NVIDIA RTX A1000': predicted on a100")


def test_the_predicted_step_is_the_simulators_on_the_devices_spec() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig.small())
    plan = lnn.parallelize(model, model.example_batch(4, torch.Generator().manual_seed(0)), "tp", 2, step="training_step")
    predicted = predict_step(plan, torch.device("cpu"))
    assert predicted is not None and (predicted.spec, predicted.note) == ("cpu", "")
    assert predicted.step_seconds == predict(plan, "cpu").step_seconds > 0
    assert predicted_values(predicted) == {PREDICTED_STEP_KEY: predicted.step_seconds * 1e3, PREDICTED_SPEC_KEY: predicted.spec_name}


def test_a_simulator_failure_warns_with_the_reason_and_predicts_nothing() -> None:
    with pytest.warns(UserWarning, match="the simulator failed: AttributeError"):
        predicted = predict_step(object(), torch.device("cpu"))  # not a plan: the simulator raises
    assert predicted is None and predicted_values(predicted) == {}


def test_the_measured_median_leaves_out_the_first_steps() -> None:
    timer = StepTimer(torch.device("cpu"))
    for _ in range(MEASURED_AFTER):
        timer.start()
        timer.stop()
    assert timer.median_seconds() is None
    for _ in range(3):
        timer.start()
        timer.stop()
    assert len(timer.seconds) == 3 and timer.median_seconds() == sorted(timer.seconds)[1] >= 0.0
