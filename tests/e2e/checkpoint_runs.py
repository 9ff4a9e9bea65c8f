"""Trainer runs for the checkpoint tests (module-level, so spawned ranks import them).

Epoch-based: each epoch is ``STEPS_PER_EPOCH`` optimizer steps and a checkpoint is saved at every
epoch's end. (With ``max_steps`` Lightning resumes an epoch-end checkpoint with the sampler's next
epoch, a DDP run included, so a resumed run would see other batches than an uninterrupted one.)
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import torch

import lightning_nnscaler as lnn  # noqa: F401 - before lightning
from lightning_nnscaler.strategy import checkpoint as strategy_checkpoint

from lightning_runs import GLOBAL_BATCH, fit_gpt  # noqa: E402

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

    def write_then_die_on_the_second_save(payload: Any, path: Path) -> None:
        if path.name.startswith("rank"):
            saves["count"] += 1
            if rank == 1 and saves["count"] == 2:
                path.with_name(f".{path.name}.tmp").write_bytes(b"half a file")
                os.kill(os.getpid(), signal.SIGKILL)
        write(payload, path)

    strategy_checkpoint.write_atomically = write_then_die_on_the_second_save  # what save_sharded calls
    runs_worker(rank, world_size, [("killed", "nnscaler_tp", 2, {"checkpoint_dir": directory, "validate": False})])
