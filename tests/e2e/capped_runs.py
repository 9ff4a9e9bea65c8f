"""Fits under a per-process memory cap below what one device needs (``resource.RLIMIT_DATA`` in each rank).

``capped_worker`` caps its rank's data segment (heap and private writable mappings: every tensor) at what the
process holds when it starts plus ``budget`` bytes, then fits a GPT whose AdamW training state alone is larger
than the budget, built under ``trainer.init_module()``. It reports the per-batch losses, or the error that ended
the fit (a rank that cannot allocate fails the run).
"""

from __future__ import annotations

import ctypes
import os
import resource
from typing import Any

import torch

import lightning_nnscaler as lnn  # noqa: F401 - registers the strategies

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_runs import StepRecorder, replica_batch_size  # noqa: E402
from lightning_nnscaler.models.gpt import GPT, GPTConfig  # noqa: E402

CONFIG = GPTConfig(vocab_size=8192, seq_len=64, hidden=768, layers=6, heads=12)
"""55M parameters: 0.88 GB of fp32 AdamW state (parameters, gradients, two moments)."""
GLOBAL_BATCH, STEPS = 4, 3


def data_segment_bytes() -> int:
    """This process's data segment now (what ``RLIMIT_DATA`` bounds)."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmData:"))
    return int(line.split()[1]) * 1024


M_MMAP_THRESHOLD = -3
"""``mallopt``'s parameter number for glibc's mmap threshold."""


def fix_mmap_threshold() -> None:
    """Fix glibc's mmap threshold at its default (128 KiB), as every run here does alike.

    glibc raises the threshold each time a large block is freed, after which tensors come from the heap, which
    keeps their pages once they are freed: the data segment then grows with every tensor that was ever alive,
    not with the most alive at once. Fixed, each freed tensor's pages go back, so the cap bounds what a rank
    holds at once, as a GPU's memory does.
    """
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 128 * 1024)


def capped_worker(rank: int, world_size: int, strategy: str, budget: int | None) -> dict[str, Any]:
    """One capped fit on this rank (``budget`` None: uncapped): its losses, or the error it stopped with."""
    torch.set_num_threads(1)
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    fix_mmap_threshold()
    if budget is not None:
        cap = data_segment_bytes() + budget
        resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    tokens = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH * STEPS, CONFIG.seq_len + 1), generator=torch.Generator().manual_seed(1))
    data = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    recorder = StepRecorder()
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=world_size, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=[recorder],
    )
    torch.manual_seed(0)
    with trainer.init_module():
        model = GPT(CONFIG)
    try:
        trainer.fit(model, DataLoader(data, batch_size=replica_batch_size(strategy, world_size, GLOBAL_BATCH)))
    except (MemoryError, RuntimeError) as error:
        return {"error": f"{type(error).__name__}: {error}"[:300]}
    return {"losses": recorder.losses}
