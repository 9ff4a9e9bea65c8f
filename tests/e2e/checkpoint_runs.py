"""Trainer runs for the checkpoint tests (module-level, so spawned ranks import them).

Epoch-based: each epoch is ``STEPS_PER_EPOCH`` optimizer steps and a checkpoint is saved at every
epoch's end. (With ``max_steps`` Lightning resumes an epoch-end checkpoint with the sampler's next
epoch, a DDP run included, so a resumed run would see other batches than an uninterrupted one.)
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

import lightning_nnscaler as lnn  # noqa: F401 - registers the strategies
from lightning_nnscaler.strategy import checkpoint as strategy_checkpoint

from lightning_nnscaler.checkpoint import CheckpointError, layout  # noqa: E402

import lightning as L  # noqa: E402

from lightning_runs import GLOBAL_BATCH, TokenDataset, build_model, fit_gpt, replica_batch_size  # noqa: E402

STEPS_PER_EPOCH = 10


def fit_epochs(strategy: str, devices: int, epochs: int, **options: Any) -> dict[str, Any]:
    """``fit_gpt`` for ``epochs`` epochs of ``STEPS_PER_EPOCH`` steps."""
    return fit_gpt(strategy, devices=devices, steps=-1, max_epochs=epochs, samples=GLOBAL_BATCH * STEPS_PER_EPOCH, **options)


def runs_worker(rank: int, world_size: int, runs: list[tuple[str, str, int, dict[str, Any]]]) -> dict[str, Any]:
    """Every ``(label, strategy, epochs, options)`` in turn, in one process group (as torchrun starts them)."""
    torch.set_num_threads(1)
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    return {label: fit_epochs(strategy, world_size, epochs, **options) for label, strategy, epochs, options in runs}


def killed_while_saving_worker(rank: int, world_size: int, directory: str) -> None:
    """Train 2 epochs with tp, saving a checkpoint at each epoch's end into ``directory``; rank 1 is
    killed (SIGKILL) halfway through writing its file of the second checkpoint."""
    saves = {"count": 0}
    write = strategy_checkpoint.write_atomically

    def write_then_die_on_the_second_save(payload: Any, path: Path) -> dict[str, Any]:
        if path.name.startswith("rank"):
            saves["count"] += 1
            if rank == 1 and saves["count"] == 2:
                path.with_name(f".{path.name}.tmp").write_bytes(b"half a file")
                os.kill(os.getpid(), signal.SIGKILL)
        return write(payload, path)

    strategy_checkpoint.write_atomically = write_then_die_on_the_second_save  # what save_sharded calls
    runs_worker(rank, world_size, [("killed", "nnscaler_tp", 2, {"checkpoint_dir": directory, "validate": False})])


def rank_zero_only_save_worker(rank: int, world_size: int, path: str) -> str | None:
    """Fit 2 steps with tp, then call ``trainer.save_checkpoint`` on rank 0 only (the mistake); the other
    ranks go on with other work. Returns rank 0's error message."""
    torch.set_num_threads(1)
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    strategy_checkpoint.AGREEMENT_TIMEOUT_S = 5.0
    trainer = L.Trainer(
        strategy="nnscaler_tp", accelerator="cpu", devices=world_size, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    train = torch.utils.data.DataLoader(TokenDataset(4 * GLOBAL_BATCH, seed=1), batch_size=replica_batch_size("nnscaler_tp", world_size))
    trainer.fit(build_model(), train)
    if not trainer.is_global_zero:
        time.sleep(12)  # busy elsewhere: it never reaches the save (until well after rank 0 gave up waiting for it)
        return None
    try:
        trainer.save_checkpoint(path)
    except CheckpointError as error:
        return str(error)
    return "saved without the other ranks"


def killed_during_overwrite_worker(rank: int, world_size: int, directory: str) -> None:
    """Train 2 epochs with tp and ``ModelCheckpoint(save_last=True)``; rank 0 is killed (SIGKILL) in the commit
    that overwrites ``last.ckpt`` the second time, after writing the new pointer and before switching to it."""
    import functools

    import lightning_runs

    lightning_runs.ModelCheckpoint = functools.partial(lightning_runs.ModelCheckpoint, save_last=True)
    commits = {"last": 0, "current": None}
    commit = strategy_checkpoint.commit

    def counting_commit(partial: Path, path: Any, *args: Any, **kwargs: Any) -> None:
        commits["current"] = Path(path).name
        commits["last"] += Path(path).name == "last.ckpt"
        return commit(partial, path, *args, **kwargs)

    def die_before_the_switch(step: str) -> None:
        if rank == 0 and step == "pointer written" and commits["current"] == "last.ckpt" and commits["last"] == 2:
            os.kill(os.getpid(), signal.SIGKILL)

    strategy_checkpoint.commit = counting_commit  # what save_sharded calls
    layout._after_step = die_before_the_switch
    runs_worker(rank, world_size, [("killed", "nnscaler_tp", 2, {"checkpoint_dir": directory, "validate": False})])


def fit_for_saving(strategy: str, steps: int = 2, ckpt_path: str | None = None) -> L.Trainer:
    """A one-device Trainer with ``strategy`` fitted to ``steps`` steps (resumed from ``ckpt_path`` if given; no
    automatic checkpoints), ready for ``trainer.save_checkpoint``."""
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    train = torch.utils.data.DataLoader(TokenDataset(4 * GLOBAL_BATCH, seed=1), batch_size=replica_batch_size(strategy, 1))
    trainer.fit(build_model(), train, ckpt_path=ckpt_path)
    return trainer


def save_repeatedly_job(path: str, label: int, saves: int, start: Any, results: Any) -> None:
    """One job of its own (a one-device nnscaler Trainer in this process, with its own process group): fit 2
    steps, wait at ``start``, then ``trainer.save_checkpoint(path)`` ``saves`` times; each outcome goes to
    ``results`` as ``(label, "saved" | "busy" | the error)``."""
    from lightning_nnscaler.launch import free_port

    torch.set_num_threads(1)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID"):
        os.environ.pop(name, None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), LOCAL_RANK="0", NODE_RANK="0")
    trainer = fit_for_saving("nnscaler")
    start.wait()
    for _ in range(saves):
        try:
            trainer.save_checkpoint(path)
            results.put((label, "saved"))
        except CheckpointError as error:
            results.put((label, "busy" if "another process is saving to" in str(error) else f"CheckpointError: {error}"))
        except Exception as error:  # noqa: BLE001 - the bug: FileNotFoundError on the other job's temporary names
            results.put((label, f"{type(error).__name__}: {error}"))
