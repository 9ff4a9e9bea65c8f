"""A Lightning user's ordinary step code trains and logs under nnscaler as under ddp (2 gloo ranks):
a warm-up factor from ``self.global_step`` written with the numbers on the left, logging every other
batch by ``batch_idx``, ``self.log(name, loss.item())``, the step number logged, and torchmetrics
``Accuracy`` (step and epoch) and ``MeanMetric`` (epoch) logged as objects; the CSV logger's files
agree at rtol 1e-5."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from support.ranks import launch_ranks

from habit_runs import BATCHES, EPOCHS, habits_worker  # noqa: E402 - tests/e2e is on sys.path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return launch_ranks(habits_worker, 2, str(tmp_path_factory.mktemp("habits")), timeout=240)[0]


def _numbers(rows: list[dict[str, str]]) -> list[dict[str, float]]:
    return [{key: float(value) for key, value in row.items() if value != ""} for row in rows]


@pytest.mark.timeout(300)
def test_habits_log_and_train_as_under_ddp(runs: dict[str, Any]) -> None:
    ddp, ours = runs["ddp"], runs["nnscaler"]
    assert len(ours["logged"]) == BATCHES * EPOCHS
    assert [sorted(entry) for entry in ours["logged"]] == [sorted(entry) for entry in ddp["logged"]]
    assert [entry["step_seen"] for entry in ours["logged"]] == list(map(float, range(BATCHES * EPOCHS)))
    for mine, theirs in zip(ours["logged"], ddp["logged"]):
        torch.testing.assert_close(torch.tensor([mine[key] for key in sorted(mine)]), torch.tensor([theirs[key] for key in sorted(mine)]), rtol=1e-5, atol=1e-7)
    csv_ours, csv_ddp = _numbers(ours["csv"]), _numbers(ddp["csv"])
    assert [sorted(row) for row in csv_ours] == [sorted(row) for row in csv_ddp]
    assert any("sampled_loss" in row for row in csv_ours) and sum("mean_loss" in row for row in csv_ours) == EPOCHS
    assert sum("train_accuracy_epoch" in row for row in csv_ours) == EPOCHS
    for mine, theirs in zip(csv_ours, csv_ddp):
        torch.testing.assert_close(torch.tensor([mine[key] for key in sorted(mine)]), torch.tensor([theirs[key] for key in sorted(mine)], dtype=torch.float32), rtol=1e-5, atol=1e-7)
    for key, value in ddp["state"].items():
        torch.testing.assert_close(ours["state"][key], value, rtol=1e-5, atol=1e-6, msg=lambda message, key=key: f"{key}: {message}")

