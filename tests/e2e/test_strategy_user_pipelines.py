"""Trainer(strategy="nnscaler_1f1b" / "nnscaler_gpipe") trains user models on 2 gloo ranks as one device does.

GPT-2 (loss from ``labels=``), Qwen2 and timm's ConvNeXt (logits and ``F.cross_entropy``), and a
BatchNorm CNN, from tiny configs (``user_pipeline_runs``), each trained ``STEPS`` steps of
``GLOBAL_BATCH`` samples, all runs in one 2-rank process group started as torchrun would.

A 2-stage pipeline over 2 ranks is one data-parallel replica that reads the whole global batch; ddp on
the same 2 ranks reads half of it per rank and averages the gradients, which for a mean loss over equal
halves is the global batch's gradient: ddp is the single-device oracle here (``replica_batch_size``, as
``test_strategy_parity`` does). Per step, the loss each rank returns (averaged over ranks) and the
``train_loss`` each rank logs must equal ddp's at rtol 1e-5 (ddp logs its own half batch's loss, so
the mean of its ranks' logged values is the global one; the pipeline's single replica logs the global
loss on both ranks), and so must the final weights.

BatchNorm is the exception by design: a pipeline normalizes each microbatch with its own statistics
(as ``torch.distributed.pipelining`` does), ddp each rank's half batch. The CNN is compared instead
with an oracle that has the same statistics: eager training on one device that runs each step's rows
as the pipeline's microbatches (``microbatched_single_device``); losses, logged values, weights and
running statistics at the same tolerances. The running statistics move once per step, by the last
microbatch's update (what the plan does; torch.distributed.pipelining updates them once per microbatch).
One device normalizing the whole batch at once trains measurably otherwise (checked, so the oracle matters).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from support.ranks import launch_ranks

from user_pipeline_runs import STEPS, microbatched_single_device, pipeline_worker  # noqa: E402 - tests/e2e is on sys.path

PIPELINES = {"1f1b": "nnscaler_1f1b", "gpipe": "nnscaler_gpipe"}
DDP_ORACLE = ("gpt2", "qwen2", "convnext")
BATCH_NORM = "bn_cnn"


def runs() -> list[tuple[str, str, str]]:
    """(label, strategy, model) of every run, in order."""
    listed = []
    for model in (*DDP_ORACLE, BATCH_NORM):
        if model != BATCH_NORM:
            listed.append((f"{model} ddp", "ddp", model))
        listed += [(f"{model} {schedule}", strategy, model) for schedule, strategy in PIPELINES.items()]
    return listed


@pytest.fixture(scope="module")
def results() -> list[dict[str, dict[str, Any]]]:
    return launch_ranks(pipeline_worker, 2, runs(), timeout=240)


def assert_close_states(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], label: str) -> None:
    assert actual.keys() == expected.keys(), label
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=1e-5, atol=1e-5, msg=lambda message, k=key: f"{label} {k}: {message}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", list(PIPELINES))
@pytest.mark.parametrize("model", DDP_ORACLE)
def test_a_pipelined_user_model_trains_like_ddp(results: list[dict], model: str, schedule: str) -> None:
    expected = results[0][f"{model} ddp"]
    ddp_logged = torch.tensor([by_label[f"{model} ddp"]["logged"] for by_label in results]).mean(dim=0)  # each rank's half batch
    for rank, by_label in enumerate(results):
        label, actual = f"{model} {schedule} rank {rank}", by_label[f"{model} {schedule}"]
        assert actual["microbatches"] == 2 and len(actual["losses"]) == len(expected["losses"]) == STEPS, label
        torch.testing.assert_close(torch.tensor(actual["losses"]), torch.tensor(expected["losses"]), rtol=1e-5, atol=1e-6, msg=lambda m, s=label: f"{s} losses: {m}")
        torch.testing.assert_close(torch.tensor(actual["logged"]), ddp_logged, rtol=1e-5, atol=1e-6, msg=lambda m, s=label: f"{s} logged train_loss: {m}")
        assert_close_states(actual["state"], expected["state"], label)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", list(PIPELINES))
def test_a_pipelined_batch_norm_cnn_trains_like_one_device_with_per_microbatch_statistics(results: list[dict], schedule: str) -> None:
    run = results[0][f"{BATCH_NORM} {schedule}"]
    expected = microbatched_single_device(BATCH_NORM, run["microbatches"])
    for rank, by_label in enumerate(results):
        label, actual = f"{BATCH_NORM} {schedule} rank {rank}", by_label[f"{BATCH_NORM} {schedule}"]
        assert actual["microbatches"] == 2 and len(actual["losses"]) == STEPS, label
        torch.testing.assert_close(torch.tensor(actual["losses"]), torch.tensor(expected["losses"]), rtol=1e-5, atol=1e-6, msg=lambda m, s=label: f"{s} losses: {m}")
        torch.testing.assert_close(torch.tensor(actual["logged"]), torch.tensor(expected["losses"]), rtol=1e-5, atol=1e-6, msg=lambda m, s=label: f"{s} logged: {m}")
        assert_close_states(actual["state"], expected["state"], label)
    whole_batch = microbatched_single_device(BATCH_NORM, 1)["losses"]
    # measured: 4.6e-4 to 1.2e-3 relative, step by step
    assert not torch.allclose(torch.tensor(whole_batch), torch.tensor(expected["losses"]), rtol=1e-4, atol=0.0), (whole_batch, expected["losses"])
