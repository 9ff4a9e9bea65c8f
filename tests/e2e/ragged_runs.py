"""A ddp-style script whose DataLoader keeps a ragged last batch (``drop_last=False``, the default),
and one whose batches have different sequence lengths, run under several strategies in one
process group (module-level, so launched processes import it)."""

from __future__ import annotations

import os
from typing import Any

import torch

import lightning_nnscaler  # noqa: F401 - before lightning (keeps torchvision importable)

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from batch_runs import BatchRecorder  # noqa: E402 - the same per-step recorder
from lightning_runs import TokenDataset, build_model  # noqa: E402

REPLICA_BATCH = 2
SAMPLES = 13  # 2 replicas: 7 samples each (one repeated), batches of 2, 2, 2, 1; 1 replica: six of 2, then 1


def cut_to_varying_length(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack the samples and keep 16, 12 or 8 tokens (chosen by the batch's first token): a collate that
    pads to each batch's longest sequence gives batches of such varying lengths."""
    tokens, targets = (torch.stack(column) for column in zip(*samples))
    length = tokens.shape[1] - 4 * (int(tokens[0, 0]) % 3)
    return tokens[:, :length].contiguous(), targets[:, :length].contiguous()


def ragged_fit(strategy: str, devices: int, varying_length: bool = False) -> dict[str, Any]:
    """One epoch over ``SAMPLES`` samples, in order, the last batch ragged; only ``strategy`` changes."""
    torch.manual_seed(0)
    recorder = BatchRecorder()
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder],
    )
    collate = cut_to_varying_length if varying_length else None
    train = DataLoader(TokenDataset(SAMPLES, seed=1), batch_size=REPLICA_BATCH, shuffle=False, collate_fn=collate)
    trainer.fit(build_model(), train)
    plans = getattr(trainer.strategy, "_plans_by_shape", {})
    return {"logged": recorder.logged, "batches": recorder.batches, "plans": len(plans), "steps": trainer.global_step}


def ragged_worker(rank: int, world_size: int, runs: list[tuple[str, bool]]) -> dict[str, dict[str, Any]]:
    """``ragged_fit`` for every (strategy, varying_length) in turn, in one process group."""
    torch.set_num_threads(1)
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    return {f"{strategy}{'_varying' if varying else ''}": ragged_fit(strategy, world_size, varying) for strategy, varying in runs}
