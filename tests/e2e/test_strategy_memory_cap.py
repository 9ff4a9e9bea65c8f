"""A model trains on 4 ranks under a per-process memory cap that one device cannot train it under.

Each rank's data segment (every tensor it allocates) is capped at what it holds at start plus ``BUDGET``
(``capped_runs``); the GPT (55M parameters, 0.88 GB of AdamW state) is built under ``trainer.init_module()``.
Under the cap one device (``ddp`` on 1 rank) and ``ddp`` on 4 ranks fail to allocate; ``nnscaler_tp``,
``nnscaler_1f1b`` and ``nnscaler_zero3`` (one layer gathered at a time) on 4 ranks train with the uncapped
one-device run's losses (rtol 1e-5). Every run fixes glibc's mmap threshold alike (``capped_runs``), so the cap
bounds the tensors alive at once. Measured budgets (this machine, fresh processes per rank, before the threshold
was fixed): one device (``auto``) needs over 980 MiB and ``ddp`` on 1 rank over 1100; ddp on 4 ranks fails at
900; tp on 4 passes at 750 (fails at 650) and 1f1b at 720.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_nnscaler.launch import launch

from capped_runs import capped_worker  # noqa: E402

BUDGET = 860 * 2**20


def capped(strategy: str, devices: int, budget: int | None = BUDGET) -> list[dict[str, Any]] | str:
    """Every rank's report, or the launch's error (a rank that fails to allocate may take its peers down)."""
    try:
        return launch(capped_worker, devices, strategy, budget, timeout=300)  # fresh processes: no fork server's state
    except Exception as error:  # noqa: BLE001 - the failure is the result here
        return str(error)


@pytest.fixture(scope="module")
def one_device() -> list[float]:
    """The uncapped one-device losses (ddp on 1 rank: the same sampler as every run here)."""
    return capped("ddp", 1, None)[0]["losses"]


def failed_to_allocate(result: list[dict[str, Any]] | str) -> bool:
    text = result if isinstance(result, str) else " ".join(report.get("error", "") for report in result)
    return "can't allocate memory" in text or "MemoryError" in text


@pytest.mark.timeout(400)
@pytest.mark.parametrize("strategy", ["nnscaler_tp", "nnscaler_1f1b", "nnscaler_zero3"])
def test_a_plan_trains_under_a_cap_one_device_cannot(one_device: list[float], strategy: str) -> None:
    reports = capped(strategy, 4)
    assert not isinstance(reports, str), reports
    for report in reports:
        assert "losses" in report, report
        torch.testing.assert_close(torch.tensor(report["losses"]), torch.tensor(one_device), rtol=1e-5, atol=0)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("strategy, devices", [("ddp", 1), ("ddp", 4)])
def test_one_device_and_ddp_fail_under_the_cap(strategy: str, devices: int) -> None:
    assert failed_to_allocate(capped(strategy, devices))

