"""Sharded checkpoints of NnScalerStrategy: resume under the same or another recipe and world size,
merge to a plain checkpoint, and survive a rank killed while saving.

Saved: tp on 2 ranks, 1 epoch of 10 steps. Resumed to 2 epochs: (a) tp on 2 ranks, (b) dp on 2
ranks, (c) tp on 4 ranks, (d) the 1F1B pipeline on 2 ranks; and saved under 1F1B, resumed under tp;
steps 11-20 must equal an uninterrupted 2-epoch tp run.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

import lightning_nnscaler as lnn  # noqa: F401 - registers the strategies
from lightning_nnscaler import checkpoint
from lightning_nnscaler.launch import LaunchError
from support.ranks import launch_ranks

import lightning as L  # noqa: E402

from checkpoint_runs import (  # noqa: E402
    STEPS_PER_EPOCH, killed_during_overwrite_worker, killed_while_saving_worker, rank_zero_only_save_worker, runs_worker,
)
from lightning_runs import GLOBAL_BATCH, TokenDataset, build_model  # noqa: E402

SAVED = "epoch=0-step=10.ckpt"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def two_ranks(saved: Path) -> dict:
    resume = {"resume_from": str(saved / SAVED)}
    runs = [
        ("uninterrupted tp", "nnscaler_tp", 2, {"validate": False}),
        ("tp saving", "nnscaler_tp", 1, {"checkpoint_dir": str(saved)}),
        ("tp resumed", "nnscaler_tp", 2, {**resume, "validate": False}),
        ("dp resumed", "nnscaler", 2, {**resume, "validate": False}),
        ("1f1b resumed", "nnscaler_1f1b", 2, {**resume, "validate": False}),
        ("1f1b saving", "nnscaler_1f1b", 1, {"checkpoint_dir": str(saved / "1f1b")}),
        ("tp resumed from 1f1b", "nnscaler_tp", 2, {"resume_from": str(saved / "1f1b" / SAVED), "validate": False}),
    ]
    return launch_ranks(runs_worker, 2, runs, timeout=280)[0]


@pytest.fixture(scope="module")
def four_ranks(saved: Path, two_ranks: dict) -> dict:
    runs = [("tp4 resumed", "nnscaler_tp", 2, {"resume_from": str(saved / SAVED), "validate": False})]
    return launch_ranks(runs_worker, 4, runs, timeout=280)[0]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("label", ["tp resumed", "dp resumed", "tp4 resumed", "1f1b resumed", "tp resumed from 1f1b"])
def test_resumed_steps_equal_an_uninterrupted_run(two_ranks: dict, four_ranks: dict, label: str) -> None:
    expected = two_ranks["uninterrupted tp"]["losses"][STEPS_PER_EPOCH:]
    actual = {**two_ranks, **four_ranks}[label]["losses"]
    assert len(expected) == len(actual) == STEPS_PER_EPOCH
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    final = {**two_ranks, **four_ranks}[label]["state"]
    for key, value in two_ranks["uninterrupted tp"]["state"].items():
        torch.testing.assert_close(final[key], value, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{label} {k}: {m}")


@pytest.mark.timeout(600)
def test_each_rank_writes_its_own_pieces_and_the_metadata_names_the_plan(two_ranks: dict, saved: Path) -> None:
    directory = saved / SAVED
    metadata = checkpoint.read_metadata(directory)
    assert (metadata["recipe"], metadata["world_size"], len(metadata["plan_hash"])) == ("tp", 2, 64)
    assert sorted(metadata["files"]) == ["common.pt", "rank00000-of-00002.pt", "rank00001-of-00002.pt"]
    files = checkpoint.current_save(directory)[0]
    ranks = [torch.load(files / checkpoint.rank_file_name(rank, 2), weights_only=True) for rank in range(2)]
    # tp splits the FFN's first linear by rows: each rank writes one half, and no element twice.
    halves = [[piece for piece in rank["model"] if piece["key"] == "blocks.0.mlp.fc1.weight"] for rank in ranks]
    assert [len(pieces) for pieces in halves] == [1, 1]
    assert halves[0][0]["value"].numel() == halves[1][0]["value"].numel()
    model_elements = sum(value.numel() for value in build_model().state_dict().values())
    written = sum(piece["value"].numel() for rank in ranks for piece in rank["model"])
    assert written <= model_elements  # a replicated box is written by one rank only (tied weights once)
    assert checkpoint.describe(directory, verify=True)["leftovers"] == [], "nothing is left over after a finished save"
    assert [record["hash"] for record in metadata["files"].values()] and all(rank["save"]["global_step"] == STEPS_PER_EPOCH for rank in ranks)


@pytest.mark.timeout(600)
def test_merged_checkpoint_loads_with_strategy_auto(two_ranks: dict, saved: Path, tmp_path: Path) -> None:
    merged = tmp_path / "merged.ckpt"
    completed = subprocess.run(["lightning-nnscaler", "ckpt", "merge", str(saved / SAVED), str(merged)], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-3000:]
    plain = torch.load(merged, weights_only=True)
    assert plain["global_step"] == STEPS_PER_EPOCH and len(plain["optimizer_states"][0]["state"]) == len(list(build_model().parameters()))
    trainer = L.Trainer(strategy="auto", accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    val = torch.utils.data.DataLoader(TokenDataset(2 * GLOBAL_BATCH, seed=2), batch_size=GLOBAL_BATCH)
    val_loss = trainer.validate(build_model(), val, ckpt_path=str(merged), verbose=False)[0]["val_loss"]
    assert val_loss == pytest.approx(two_ranks["tp saving"]["val_loss"], rel=1e-5)


@pytest.mark.timeout(300)
def test_a_rank_killed_while_saving_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="rank 1 exited with code -9"):
        launch_ranks(killed_while_saving_worker, 2, str(tmp_path), timeout=240, collective_timeout=20)
    first = tmp_path / SAVED
    assert checkpoint.load(first)["global_step"] == STEPS_PER_EPOCH
    second = tmp_path / "epoch=1-step=20.ckpt"
    partial, = second.glob(".partial-*")  # the interrupted save, never loaded; the next save to that path removes it
    with pytest.raises(checkpoint.CheckpointError, match=r"has no CURRENT: it is not a finished lightning-nnscaler checkpoint .*\.partial-"):
        checkpoint.load(second)
    info = subprocess.run(["lightning-nnscaler", "ckpt", "info", "--verify", str(first)], capture_output=True, text=True, timeout=120)
    assert info.returncode == 0 and json.loads(info.stdout)["recipe"] == "tp"
    refused = subprocess.run(["lightning-nnscaler", "ckpt", "info", str(second)], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1 and ".partial-" in refused.stderr


@pytest.mark.timeout(300)
def test_a_save_called_on_rank_0_only_is_refused_by_name(tmp_path: Path) -> None:
    message = launch_ranks(rank_zero_only_save_worker, 2, str(tmp_path / "manual.ckpt"), timeout=240, collective_timeout=60)[0]
    assert "every rank must call trainer.save_checkpoint" in message and "not only rank 0" in message, message
    assert not (tmp_path / "manual.ckpt").exists()


@pytest.mark.timeout(600)
def test_a_run_killed_while_overwriting_last_ckpt_resumes_from_it(two_ranks: dict, tmp_path: Path) -> None:
    with pytest.raises(LaunchError):
        launch_ranks(killed_during_overwrite_worker, 2, str(tmp_path), timeout=240, collective_timeout=20)
    last = tmp_path / "last.ckpt"
    assert checkpoint.load(last)["global_step"] == STEPS_PER_EPOCH  # the old save: killed before the switch
    assert checkpoint.describe(last)["leftovers"], "the interrupted save's directory is listed"
    runs = [("resumed from last", "nnscaler_tp", 2, {"resume_from": str(last), "validate": False})]
    resumed = launch_ranks(runs_worker, 2, runs, timeout=280)[0]["resumed from last"]
    expected = two_ranks["uninterrupted tp"]["losses"][STEPS_PER_EPOCH:]
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(expected), rtol=1e-5, atol=1e-6)
