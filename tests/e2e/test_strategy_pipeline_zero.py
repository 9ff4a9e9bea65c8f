"""ZeRO-3 inside a pipeline under the Trainer at 4 gloo ranks: ``hybrid3d`` with dp 2 x pp 2 and ``zero=3`` (each
stage's parameters sharded over its 2 replicas, gathered for the step's microbatches, its gradients reduce-scattered
once after its last backward) gives ddp's per-batch losses, logged and validation losses and final weights (rtol 1e-5)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from support.ranks import launch_ranks

from lightning_runs import parity_worker  # noqa: E402 - tests/e2e is on sys.path

OPTIONS = {"steps": 4}


@pytest.mark.timeout(300)
def test_hybrid3d_with_zero3_trains_like_ddp() -> None:
    label = "hybrid3d dp=2 pp=2 zero=3"
    runs: list[tuple[str, Any, dict[str, Any]]] = [
        ("ddp", "ddp", OPTIONS), (label, {"recipe": "hybrid3d", "dp": 2, "pp": 2, "zero": 3}, OPTIONS),
    ]
    results = launch_ranks(parity_worker, 4, runs, timeout=240)[0]
    ours, ddp = results[label], results["ddp"]
    assert ours["boxes"] and set(ours["boxes"]) < set(ddp["state"])  # rank 0 holds its stage's parameters alone
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(ddp["losses"]), rtol=1e-5, atol=1e-6)
    assert ours["train_loss"] == pytest.approx(ddp["train_loss"], rel=1e-5)
    assert ours["val_loss"] == pytest.approx(ddp["val_loss"], rel=1e-5)
    for key, value in ddp["state"].items():
        torch.testing.assert_close(ours["state"][key], value, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
