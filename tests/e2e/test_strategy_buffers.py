"""Buffers written in training_step train as under ddp on 2 gloo ranks (issue 34).

BatchNorm2d under nnscaler dp and zero3: each replica normalizes with its own rows' statistics (no
activation all-gather), so the losses equal ddp's; the running statistics and num_batches_tracked
each rank ends with, and the validation accuracy after fit, equal ddp's on every rank. An EMA and a
sample counter written in place end at ddp's values.

``Trainer(sync_batchnorm=True)`` converts BatchNorm2d to SyncBatchNorm under nnscaler as under ddp: the plan
all-reduces per-channel sums, so each rank's losses and running statistics equal ddp's (with a CPU SyncBatchNorm
that all-reduces the same sums over gloo: torch's refuses CPU tensors).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from support.ranks import launch_ranks

from buffer_runs import buffer_worker  # noqa: E402 - tests/e2e is on sys.path

STRATEGIES = ("nnscaler", "nnscaler_zero3")
RUNS = [(strategy, model) for model in ("bn", "counting") for strategy in ("ddp", *STRATEGIES)]
SYNC_RUNS = [(strategy, "syncbn") for strategy in ("ddp", *STRATEGIES)]


@pytest.fixture(scope="module")
def results() -> list[dict[str, dict[str, Any]]]:
    return launch_ranks(buffer_worker, 2, RUNS, timeout=280)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_batch_norm_trains_as_under_ddp(results: list[dict[str, dict[str, Any]]], strategy: str) -> None:
    for rank, runs in enumerate(results):
        expected, actual = runs["bn ddp"], runs[f"bn {strategy}"]
        assert actual["losses"] == pytest.approx(expected["losses"], rel=1e-5), f"rank {rank}"
        for key, value in expected["buffers"].items():
            torch.testing.assert_close(actual["buffers"][key], value, rtol=1e-5, atol=1e-6, msg=lambda text, key=key: f"rank {rank} {key}: {text}")
        assert int(actual["buffers"]["features.1.num_batches_tracked"]) == 4
        assert actual["val_acc"] == pytest.approx(expected["val_acc"], rel=1e-5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ema_and_counter_buffers_end_as_under_ddp(results: list[dict[str, dict[str, Any]]], strategy: str) -> None:
    for rank, runs in enumerate(results):
        expected, actual = runs["counting ddp"], runs[f"counting {strategy}"]
        assert int(expected["buffers"]["seen"]) == 16  # 4 steps of 4 rows per rank
        torch.testing.assert_close(actual["buffers"]["seen"], expected["buffers"]["seen"])
        torch.testing.assert_close(actual["buffers"]["ema"], expected["buffers"]["ema"], rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def sync_results() -> list[dict[str, dict[str, Any]]]:
    return launch_ranks(buffer_worker, 2, SYNC_RUNS, timeout=200)


@pytest.mark.timeout(220)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sync_batch_norm_trains_as_under_ddp(sync_results: list[dict[str, dict[str, Any]]], strategy: str) -> None:
    for rank, runs in enumerate(sync_results):
        expected, actual = runs["syncbn ddp"], runs[f"syncbn {strategy}"]
        assert actual["losses"] == pytest.approx(expected["losses"], rel=1e-5), f"rank {rank}"
        for key, value in expected["buffers"].items():
            torch.testing.assert_close(actual["buffers"][key], value, rtol=1e-5, atol=1e-6, msg=lambda text, key=key: f"rank {rank} {key}: {text}")
        assert actual["val_acc"] == pytest.approx(expected["val_acc"], rel=1e-5)
    # synchronized: both ranks end with the same running statistics, which per-replica statistics would not give
    torch.testing.assert_close(sync_results[0][f"syncbn {strategy}"]["buffers"], sync_results[1][f"syncbn {strategy}"]["buffers"])
