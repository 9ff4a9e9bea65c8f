"""ZeRO-3 cut into stages (each rank gathers one stage's parameters at a time) under the Trainer at 2 gloo ranks:
per-batch losses, the logged and validation losses and the final weights equal ddp's (rtol 1e-5)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from support.ranks import launch_ranks

from lightning_runs import parity_worker  # noqa: E402 - tests/e2e is on sys.path

OPTIONS = {"steps": 10, "model": "gpt8"}


@pytest.mark.timeout(400)
def test_zero3_with_stages_trains_like_ddp() -> None:
    runs: list[tuple[str, Any, dict[str, Any]]] = [("ddp", "ddp", OPTIONS), ("zero3 stages=4", {"recipe": "zero3", "stages": 4}, OPTIONS)]
    results = launch_ranks(parity_worker, 2, runs, timeout=300)[0]
    ours, ddp = results["zero3 stages=4"], results["ddp"]
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(ddp["losses"]), rtol=1e-5, atol=1e-6)
    assert ours["train_loss"] == pytest.approx(ddp["train_loss"], rel=1e-5)
    assert ours["val_loss"] == pytest.approx(ddp["val_loss"], rel=1e-5)
    for key, value in ddp["state"].items():
        torch.testing.assert_close(ours["state"][key], value, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
