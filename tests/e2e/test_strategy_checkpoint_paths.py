"""Where ``trainer.save_checkpoint`` of NnScalerStrategy may write, through real Trainers: a user's directory
is refused and keeps every file, two jobs saving to one path get a clear error (never another save's
FileNotFoundError) and leave a checkpoint that verifies, and ``strategy="auto"`` given a sharded checkpoint
is refused with the merge command (also in its README.txt), which makes a file it resumes from.

The one-device runs join a 1-rank gloo group in the pytest process (``one_rank_group``); the two jobs are
separate processes forked from the rank server (``support.ranks``), each with its own process group.
"""

from __future__ import annotations

import multiprocessing
import shlex
import subprocess
from pathlib import Path

import pytest
import torch

import lightning_nnscaler as lnn  # noqa: F401 - registers the strategies
from lightning_nnscaler import checkpoint
from lightning_nnscaler.checkpoint import CheckpointError
from support.ranks import RANK_PRELOAD

from checkpoint_runs import fit_for_saving, save_repeatedly_job  # noqa: E402


def tree(root: Path) -> dict[str, bytes | None]:
    return {str(path.relative_to(root)): (path.read_bytes() if path.is_file() else None) for path in sorted(root.rglob("*"))}


@pytest.mark.timeout(180)
def test_a_users_directory_is_refused_and_auto_finds_the_merge_command(one_rank_group: None, tmp_path: Path) -> None:
    trainer = fit_for_saving("nnscaler")
    users = tmp_path / "experiment"
    (users / "sub").mkdir(parents=True)
    (users / "notes.txt").write_text("my notes\n")
    (users / "sub" / "data.bin").write_bytes(b"\x00\x01" * 100)
    trainer.save_checkpoint(users / "earlier.ckpt")  # an earlier checkpoint of ours, inside the user's directory
    before = tree(tmp_path)
    with pytest.raises(CheckpointError, match=r"is an existing directory that is not a lightning-nnscaler checkpoint \(it holds earlier.ckpt"):
        trainer.save_checkpoint(users)
    assert tree(tmp_path) == before

    path = tmp_path / "epoch=0-step=2.ckpt"
    trainer.save_checkpoint(path)
    trainer.save_checkpoint(path)  # replacing our own checkpoint stays allowed
    assert checkpoint.describe(path, verify=True)["save"]["global_step"] == 2
    with pytest.raises(CheckpointError, match=r"strategy SingleDeviceStrategy cannot load ckpt_path: .* sharded checkpoint") as refused:
        fit_for_saving("auto", steps=3, ckpt_path=str(path))  # the install's callbacks_factory entry point says so
    (command,) = [part.strip() for part in str(refused.value).split(": ") if part.strip().startswith("lightning-nnscaler ckpt merge ")]
    assert "lightning-nnscaler ckpt merge " in (path / "README.txt").read_text()
    merged = subprocess.run(shlex.split(command), cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert merged.returncode == 0, merged.stderr
    resumed = fit_for_saving("auto", steps=3, ckpt_path=str(tmp_path / "epoch=0-step=2-merged.ckpt"))
    assert resumed.global_step == 3  # resumed at step 2, trained one more


@pytest.mark.timeout(180)
def test_two_jobs_saving_to_one_path_get_a_clear_error_and_the_winner_verifies(tmp_path: Path) -> None:
    path, saves = tmp_path / "last.ckpt", 6
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(RANK_PRELOAD))
    start, results = context.Barrier(2, timeout=150), context.Queue()
    jobs = [context.Process(target=save_repeatedly_job, args=(str(path), label, saves, start, results)) for label in (1, 2)]
    for job in jobs:
        job.start()
    outcomes = [results.get(timeout=160)[1] for _ in range(2 * saves)]
    for job in jobs:
        job.join(20)
    assert [job.exitcode for job in jobs] == [0, 0]
    assert [outcome for outcome in outcomes if outcome not in ("saved", "busy")] == []
    assert outcomes.count("saved") >= 2 and outcomes.count("busy") >= 1, outcomes  # the saves overlapped
    shown = checkpoint.describe(path, verify=True)
    assert shown["leftovers"] == [] and shown["save"]["global_step"] == 2 and not (path / ".lock").exists()
    assert torch.isfinite(checkpoint.load(path)["state_dict"]["lm_head.weight"]).all()
