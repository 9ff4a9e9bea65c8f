"""Where a sharded checkpoint may be saved (lightning_nnscaler.checkpoint.target): a save never deletes what it
did not write, one job saves to a path at a time (real processes), and a checkpoint opened as a file points
to ``lightning-nnscaler ckpt merge``. Saves go through the strategy's real ``save_sharded`` at one rank."""

from __future__ import annotations

import errno
import multiprocessing
import os
import re
import shlex
import signal
import time
from pathlib import Path
from typing import Any

import lightning
import pytest
import torch

import lightning_nnscaler  # noqa: F401 - registers the strategies
from lightning_nnscaler import checkpoint, cli
from lightning_nnscaler.checkpoint import CheckpointError, claim, layout, target
from lightning_nnscaler.strategy import checkpoint as strategy_checkpoint
from support.ranks import RANK_PRELOAD

BUSY = "another process is saving to"


def process_context() -> Any:
    """Separate processes, forked from a server that imported Lightning once (``support.ranks``): seconds faster than spawn."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(RANK_PRELOAD))
    return context


class Model(torch.nn.Module):
    def __init__(self, step: int = 1) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((64, 64), float(step)))


def save(path: Path, step: int = 1) -> None:
    """``save_sharded`` of a one-rank save (rank 0 writes the whole module) at ``step``."""
    lightning_checkpoint = {"global_step": step, "epoch": 0, "state_dict": {}, "pytorch-lightning_version": lightning.__version__}
    strategy_checkpoint.save_sharded(
        lightning_checkpoint, path, rank=0, world_size=1, module=Model(step), model_pieces=[], optimizer_pieces=[], group_keys=[],
        plan={"recipe": "dp", "recipe_params": {}, "plan_hash": None}, gather=lambda obj: [obj],
    )


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` (relative) with a file's bytes (None for a directory)."""
    return {str(path.relative_to(root)): (path.read_bytes() if path.is_file() else None) for path in sorted(root.rglob("*"))}


def users_directory(root: Path) -> Path:
    """The user's report: notes, a subdirectory with data, and an earlier (plain) checkpoint."""
    directory = root / "experiment"
    (directory / "sub").mkdir(parents=True)
    (directory / "notes.txt").write_text("my notes\n")
    (directory / "sub" / "data.bin").write_bytes(os.urandom(256))
    torch.save({"state_dict": {"weight": torch.ones(2)}, "pytorch-lightning_version": lightning.__version__}, directory / "earlier.ckpt")
    return directory


@pytest.mark.timeout(30)
def test_a_save_into_a_users_directory_is_refused_by_name_and_deletes_nothing(tmp_path: Path) -> None:
    directory = users_directory(tmp_path)
    before = tree(tmp_path)
    with pytest.raises(CheckpointError, match=rf"cannot save .* at {re.escape(str(directory))}: it is an existing directory that is not a "
                       r"lightning-nnscaler checkpoint \(it holds earlier.ckpt \(and 2 more\)\).*Save under another path"):
        save(directory)
    assert tree(tmp_path) == before  # nothing deleted, nothing written (not even the lock)


@pytest.mark.timeout(30)
def test_a_file_put_into_a_checkpoint_is_named_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    save(path, step=1)
    (path / "notes.txt").write_text("mine\n")
    with pytest.raises(CheckpointError, match=r"is a lightning-nnscaler sharded checkpoint, but it holds notes.txt, .*Move it out of"):
        save(path, step=2)
    (path / "notes.txt").unlink()
    inner = checkpoint.current_save(path)[0] / "extra.bin"
    inner.write_bytes(b"x")
    before = tree(tmp_path)
    with pytest.raises(CheckpointError, match=rf"it holds {inner.parent.name}/extra.bin"):
        save(path, step=2)
    assert tree(tmp_path) == before
    assert checkpoint.load(path)["global_step"] == 1


@pytest.mark.timeout(30)
def test_a_checkpoint_of_ours_is_replaced_and_an_empty_directory_is_used(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    path.mkdir()
    save(path, step=1)
    save(path, step=2)  # Lightning's convention: saving to the same path replaces it
    assert checkpoint.describe(path, verify=True)["save"]["global_step"] == 2
    assert torch.equal(checkpoint.load(path)["state_dict"]["weight"], torch.full((64, 64), 2.0))
    token = checkpoint.read_metadata(path)["save"]["token"]
    assert sorted(child.name for child in path.iterdir()) == ["CURRENT", "README.txt", f"save-{token}"]  # no lock, no earlier save


@pytest.mark.timeout(30)
def test_a_failed_first_save_leaves_nothing_and_a_link_to_a_checkpoint_is_that_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "epoch=0.ckpt"
    with monkeypatch.context() as patched:
        patched.setattr(strategy_checkpoint, "write_atomically", lambda payload, file: (_ for _ in ()).throw(OSError("disk full")))
        with pytest.raises(CheckpointError, match=r"failed on rank 0: OSError: disk full; the earlier checkpoint is kept"):
            save(path)
    assert list(tmp_path.iterdir()) == []  # no directory, lock or README left behind
    save(path, step=1)
    (tmp_path / "last.ckpt").symlink_to(path, target_is_directory=True)
    save(tmp_path / "last.ckpt", step=2)  # through the link, as strategy="auto" writes through a link to a file
    assert checkpoint.load(path)["global_step"] == 2 and (tmp_path / "last.ckpt").is_symlink()


@pytest.mark.timeout(30)
def test_a_file_at_the_path_is_refused_not_replaced(tmp_path: Path) -> None:
    path = tmp_path / "model.ckpt"
    path.write_bytes(b"a plain checkpoint another strategy saved")
    with pytest.raises(CheckpointError, match=rf"at {re.escape(str(path))}: it is a file .*Save under another path, or remove it"):
        save(path)
    assert path.read_bytes() == b"a plain checkpoint another strategy saved" and sorted(tmp_path.iterdir()) == [path]


@pytest.mark.timeout(30)
def test_a_path_that_cannot_be_created_is_refused_on_every_rank(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    with pytest.raises(CheckpointError, match=r"failed on rank 0 before writing anything: (NotADirectoryError|FileExistsError)"):
        save(tmp_path / "a-file" / "epoch=0.ckpt")  # rank 0's claim fails: the refusal reaches every rank (no hang)


@pytest.mark.timeout(30)
def test_a_path_another_save_holds_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    save(path, step=1)
    before = tree(path)
    with claim(path):  # another save holds it (flock: a second open of the lock file conflicts, as another process's would)
        with pytest.raises(CheckpointError, match=rf"{BUSY} {re.escape(str(path))} \(pid {os.getpid()} on "):
            save(path, step=2)
        assert {name for name in tree(path) if name != ".lock"} == set(before)
    assert tree(path) == before and checkpoint.load(path)["global_step"] == 1


@pytest.mark.timeout(30)
def test_a_filesystem_without_locks_saves_with_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_locks(descriptor: int, operation: int) -> None:
        raise OSError(errno.ENOSYS, "Function not implemented")  # what flock gives on Lustre mounted without -o flock

    monkeypatch.setattr(target.fcntl, "flock", no_locks)
    with pytest.warns(UserWarning, match=r"does not support file locks \(Function not implemented\): saving without the lock"):
        save(tmp_path / "last.ckpt", step=4)
    assert checkpoint.load(tmp_path / "last.ckpt")["global_step"] == 4 and not (tmp_path / "last.ckpt" / ".lock").exists()


def _claim_and_die(path: str) -> None:
    with claim(path):
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.timeout(60)
def test_a_killed_savers_lock_blocks_nothing(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    process = process_context().Process(target=_claim_and_die, args=(str(path),))
    process.start()
    process.join(50)
    assert process.exitcode == -signal.SIGKILL and (path / ".lock").is_file()  # the stale lock file stays; its flock died with it
    save(path, step=3)
    assert checkpoint.load(path)["global_step"] == 3 and not (path / ".lock").exists()


def _save_repeatedly(path: str, label: int, saves: int, start: Any, results: Any) -> None:
    """Save ``saves`` times to ``path`` (each rank file written slowly, so that the two savers overlap); report each outcome."""
    torch.set_num_threads(1)
    write = strategy_checkpoint.write_atomically

    def slow_write(payload: Any, file: Path) -> dict[str, Any]:
        time.sleep(0.03)
        return write(payload, file)

    strategy_checkpoint.write_atomically = slow_write
    start.wait()
    for index in range(saves):
        try:
            save(Path(path), step=100 * label + index)
            results.put((label, "saved"))
        except CheckpointError as error:
            results.put((label, "busy" if BUSY in str(error) else f"CheckpointError: {error}"))
        except Exception as error:  # noqa: BLE001 - the bug: FileNotFoundError on another save's temporary names
            results.put((label, f"{type(error).__name__}: {error}"))
        time.sleep(0.005 * label)


@pytest.mark.timeout(90)
def test_two_processes_saving_to_one_path_get_a_clear_error_and_the_winner_verifies(tmp_path: Path) -> None:
    path, saves = tmp_path / "last.ckpt", 8
    context = process_context()
    start, results = context.Barrier(2, timeout=60), context.Queue()
    processes = [context.Process(target=_save_repeatedly, args=(str(path), label, saves, start, results)) for label in (1, 2)]
    for process in processes:
        process.start()
    outcomes = [results.get(timeout=80) for _ in range(2 * saves)]
    for process in processes:
        process.join(20)
    assert [process.exitcode for process in processes] == [0, 0]
    unexpected = [outcome for _, outcome in outcomes if outcome not in ("saved", "busy")]
    assert unexpected == [], unexpected  # never FileNotFoundError on internal temporary names
    kinds = [outcome for _, outcome in outcomes]
    assert kinds.count("saved") >= 2 and kinds.count("busy") >= 1, kinds  # the saves overlapped, and one of them won each time
    shown = checkpoint.describe(path, verify=True)
    assert shown["leftovers"] == [] and not (path / ".lock").exists()
    step = shown["save"]["global_step"]
    assert torch.equal(checkpoint.load(path)["state_dict"]["weight"], torch.full((64, 64), float(step)))


@pytest.mark.timeout(30)
def test_a_sharded_checkpoint_opened_as_a_file_points_to_ckpt_merge(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "epoch=0-step=10.ckpt"
    save(path, step=10)
    with pytest.raises(IsADirectoryError):  # what torch.load (and so strategy="auto") does with it: we cannot change torch
        torch.load(path, weights_only=True)
    readme = (path / "README.txt").read_text()
    assert "lightning-nnscaler sharded checkpoint" in readme and 'strategy="nnscaler"' in readme
    (command,) = [line.strip() for line in readme.splitlines() if line.strip().startswith("lightning-nnscaler ckpt merge ")]
    monkeypatch.chdir(tmp_path)  # the README's command runs where the checkpoint lies
    assert cli.main(shlex.split(command)[1:]) == 0, capsys.readouterr().err
    merged = torch.load(tmp_path / "epoch=0-step=10-merged.ckpt", weights_only=True)
    assert merged["global_step"] == 10 and torch.equal(merged["state_dict"]["weight"], torch.full((64, 64), 10.0))
    for inside in (checkpoint.current_save(path)[0] / "common.pt", path / "CURRENT"):
        with pytest.raises(CheckpointError, match=rf"one file of a sharded checkpoint.*lightning-nnscaler ckpt merge {re.escape(str(path))} "):
            checkpoint.load(inside)


def test_only_names_the_layout_writes_are_its_own() -> None:
    assert [layout.own_name(name) for name in ("CURRENT", "README.txt", ".lock", "save-3f2a", ".partial-3f2a", ".CURRENT.tmp")] == [True] * 6
    assert [layout.own_name(name) for name in ("notes.txt", "sub", "save-", "saved-3f2a", "current")] == [False] * 5
    assert [layout.own_file_in_save(name) for name in ("metadata.json", "common.pt", "rank00001-of-00002.pt", ".common.pt.tmp")] == [True] * 4
    assert [layout.own_file_in_save(name) for name in ("common.pt.bak", ".notes.tmp", "rank1.pt")] == [False] * 3
