"""Trainer features under ``strategy="nnscaler_tp"`` at 2 gloo ranks, compared with ``strategy="ddp"``:
CSV / TensorBoard / W&B loggers (read back from what they wrote), LearningRateMonitor, EarlyStopping,
ModelCheckpoint on val_loss, the validate / test / predict loops, and ``precision="bf16-true"``.

One launch trains both strategies (``feature_runs.features_worker``); the tests read its results and files.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_nnscaler as lnn
from support.ranks import launch_ranks
from lightning_nnscaler.strategy.plan_logging import CODE_FOLDER, PLAN_KEY, plan_summary

from feature_runs import (  # noqa: E402 - after lightning_nnscaler
    MAX_EPOCHS, STEPS_PER_EPOCH, build_evaluated_model, features_worker, loaders,
)
from lightning_runs import GLOBAL_BATCH, build_model, parity_worker, single_device_run  # noqa: E402
from wandb_runs import read_wandb_run  # noqa: E402

STOP_EPOCH = 3  # where EARLY_STOPPING stops this run (see feature_runs.EARLY_STOPPING)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """Both strategies' results (rank 0's) and the folder their loggers and checkpoints wrote to."""
    root = tmp_path_factory.mktemp("features")
    environment = dict(os.environ)
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(root))  # no network here
    try:
        results = launch_ranks(features_worker, 2, [("ddp", "ddp", {}), ("tp", "nnscaler_tp", {"wandb": True})], str(root), timeout=420)
    finally:
        os.environ.clear()
        os.environ.update(environment)
    return root, results[0]


def read_csv_metrics(save_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """``(step, value)`` per metric of the only CSVLogger version (rank 0 alone writes one)."""
    versions = sorted((save_dir / "csv").iterdir())
    assert [version.name for version in versions] == ["version_0"]
    metrics: dict[str, list[tuple[int, float]]] = {}
    with open(versions[0] / "metrics.csv") as file:
        for row in csv.DictReader(file):
            for key, value in row.items():
                if key not in ("epoch", "step") and value:
                    metrics.setdefault(key, []).append((int(row["step"]), float(value)))
    return metrics


def read_tensorboard_scalars(save_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """``(step, value)`` per scalar tag of the only TensorBoardLogger version."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    versions = sorted((save_dir / "tb").iterdir())
    assert [version.name for version in versions] == ["version_0"]
    events = EventAccumulator(str(versions[0]), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def assert_series_close(actual: list[tuple[int, float]], expected: list[tuple[int, float]]) -> None:
    """Same steps, values equal at rtol 1e-5."""
    assert [step for step, _ in actual] == [step for step, _ in expected]
    torch.testing.assert_close(torch.tensor([v for _, v in actual]), torch.tensor([v for _, v in expected]), rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(480)
def test_csv_and_tensorboard_get_ddps_metrics_once(runs: tuple[Path, dict[str, Any]]) -> None:
    root, _ = runs
    steps = (STOP_EPOCH + 1) * STEPS_PER_EPOCH
    for read in (read_csv_metrics, read_tensorboard_scalars):
        ours, ddp = read(root / "tp"), read(root / "ddp")
        assert {"train_loss", "val_loss", "lr-AdamW/pg1", "lr-AdamW/pg2"} <= set(ours)
        for metric in ("train_loss", "val_loss", "lr-AdamW/pg1", "lr-AdamW/pg2"):
            assert_series_close(ours[metric], ddp[metric])
        # Written once, not once per rank: one train_loss per step; one val_loss per epoch, then trainer.validate's.
        assert [step for step, _ in ours["train_loss"]] == list(range(steps))
        epoch_ends = [(epoch + 1) * STEPS_PER_EPOCH - 1 for epoch in range(STOP_EPOCH + 1)]
        assert [step for step, _ in ours["val_loss"]] == [*epoch_ends, steps]
    # The logged losses are the single-device run's (same data order as the Trainer's first steps).
    expected_losses, _ = single_device_run(steps=STEPS_PER_EPOCH)
    ours = read_csv_metrics(root / "tp")["train_loss"][:STEPS_PER_EPOCH]
    torch.testing.assert_close(torch.tensor([v for _, v in ours]), torch.tensor(expected_losses), rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(480)
def test_callbacks_decide_as_under_ddp(runs: tuple[Path, dict[str, Any]]) -> None:
    root, results = runs
    ours, ddp = results["tp"], results["ddp"]
    # EarlyStopping: the same epoch, mid-run.
    assert ours["stopped_epoch"] == ddp["stopped_epoch"] == STOP_EPOCH < MAX_EPOCHS - 1
    # ModelCheckpoint(monitor="val_loss"): the same best epoch and score.
    assert ours["best_model_path"] == ddp["best_model_path"]
    assert ours["best_model_path"].startswith(f"epoch={STOP_EPOCH}-")
    assert ours["best_model_score"] == pytest.approx(ddp["best_model_score"], rel=1e-5)
    # LearningRateMonitor: the warm-up LRs, step by step, for both param groups.
    learning_rates = read_csv_metrics(root / "tp")
    warmup = [min(1.0, (step + 1) / 3) * 1e-3 for step in range((STOP_EPOCH + 1) * STEPS_PER_EPOCH)]
    for group in ("lr-AdamW/pg1", "lr-AdamW/pg2"):
        assert [value for _, value in learning_rates[group]] == pytest.approx(warmup, rel=1e-12)


@pytest.mark.timeout(480)
def test_validate_test_predict_match_ddp_and_single_device(runs: tuple[Path, dict[str, Any]]) -> None:
    _, results = runs
    ours, ddp = results["tp"], results["ddp"]
    for key, value in ddp["state"].items():
        torch.testing.assert_close(ours["state"][key], value, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
    assert ours["validate"]["val_loss"] == pytest.approx(ddp["validate"]["val_loss"], rel=1e-5)
    assert ours["test"]["test_loss"] == pytest.approx(ddp["test"]["test_loss"], rel=1e-5)
    assert ours["evaluated_by"] == {"validation_step": "plan", "test_step": "plan", "predict_step": "plan"}  # forward-only plans over the pieces
    # Single device: the trained weights evaluated eagerly, batch by batch as the loops do.
    model = build_evaluated_model()
    model.load_state_dict(ours["state"])
    data = loaders(GLOBAL_BATCH)
    with torch.no_grad():
        val_loss = torch.stack([model.compute_loss(batch) for batch in data["val"]]).mean()
        test_loss = torch.stack([model.compute_loss(batch) for batch in data["test"]]).mean()
        logits = torch.cat([model(tokens) for tokens, _ in data["test"]])
    assert ours["validate"]["val_loss"] == pytest.approx(float(val_loss), rel=1e-5)
    assert ours["test"]["test_loss"] == pytest.approx(float(test_loss), rel=1e-5)
    torch.testing.assert_close(ours["predictions"], logits, rtol=1e-5, atol=1e-5)  # every rank predicts the whole set


@pytest.mark.timeout(480)
def test_wandb_gets_the_metrics_and_the_plan(runs: tuple[Path, dict[str, Any]]) -> None:
    root, results = runs
    config, summary, history, files = read_wandb_run(root / "tp")
    # Metrics: what the CSV logger got.
    csv_metrics = read_csv_metrics(root / "tp")
    for metric in ("train_loss", "val_loss", "lr-AdamW/pg1"):
        assert_series_close(history[metric], csv_metrics[metric])
    # The plan, as planned again here from a batch of the same shape (planning is deterministic).
    model = build_model()
    batch = next(iter(loaders(GLOBAL_BATCH)["train"]))
    plan = lnn.parallelize(model, batch, "tp", 2, step="training_step")
    assert plan.plan_hash == results["tp"]["plan_hash"]
    expected = plan_summary(plan)
    assert config[PLAN_KEY] == expected
    assert expected["recipe"] == "tp" and expected["world_size"] == 2
    assert expected["memory"]["rank0"]["total_bytes"] > expected["memory"]["rank0"]["parameters_bytes"] > 0
    assert summary[f"{PLAN_KEY}/plan_hash"] == plan.plan_hash
    assert summary[f"{PLAN_KEY}/memory/rank1/total_bytes"] == expected["memory"]["rank1"]["total_bytes"]
    for rank in range(2):
        assert (files / CODE_FOLDER / plan.plan_hash / f"rank{rank}.py").read_text() == plan.sources[rank]
    # Every logger gets the plan summary: the CSV logger's hparams.yaml too.
    import yaml

    assert yaml.safe_load((root / "tp" / "csv" / "version_0" / "hparams.yaml").read_text())[PLAN_KEY] == expected


@pytest.mark.timeout(300)
def test_bf16_true_trains_with_tensor_parallelism() -> None:
    runs = [
        ("tp", "nnscaler_tp", {"precision": "bf16-true", "validate": False}),
        ("ddp", "ddp", {"precision": "bf16-true", "validate": False}),
    ]
    results = launch_ranks(parity_worker, 2, runs, timeout=280)[0]
    expected_losses, _ = single_device_run()
    one_ulp = 2.0**-7  # bf16 keeps 8 significant bits: one unit in the last place is 2^-7 of the value
    torch.testing.assert_close(torch.tensor(results["tp"]["losses"]), torch.tensor(expected_losses), rtol=one_ulp, atol=0.0)
    torch.testing.assert_close(torch.tensor(results["tp"]["losses"]), torch.tensor(results["ddp"]["losses"]), rtol=one_ulp, atol=0.0)
    initial = build_model().state_dict()
    for key, value in results["tp"]["state"].items():
        if value.is_floating_point():
            assert value.dtype == torch.bfloat16, key
    assert not torch.equal(results["tp"]["state"]["lm_head.weight"], initial["lm_head.weight"].to(torch.bfloat16))
