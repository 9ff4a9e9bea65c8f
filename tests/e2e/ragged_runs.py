"""A ddp-style script whose DataLoader keeps a ragged last batch (``drop_last=False``, the default),
one whose batches have different sequence lengths, and one whose ``training_step`` logs metrics to
a CSV file, run under several strategies in one process group (module-level, so launched
processes import it)."""

from __future__ import annotations

import csv
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import lightning_nnscaler  # noqa: F401 - registers the strategies

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from batch_runs import BatchRecorder  # noqa: E402 - the same per-step recorder
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from lightning_runs import ScheduledGPT, TokenDataset, build_model  # noqa: E402
from lightning_nnscaler.models.gpt import GPTConfig  # noqa: E402

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


class LogsMetrics(ScheduledGPT):
    """Logs as the Lightning docs teach: loss, accuracy (also per epoch) and perplexity synced over the
    ranks, and the loss once more without ``sync_dist`` (each rank its own replica's)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        logits = self(tokens)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        self.log("train_loss", loss, sync_dist=True)
        self.log("train_acc", (logits.argmax(-1) == targets).float().mean(), sync_dist=True, on_epoch=True)
        self.log("perplexity", torch.exp(loss), sync_dist=True, prog_bar=True)
        self.log("replica_loss", loss)
        return loss


def metrics_fit(strategy: str, devices: int) -> dict[str, Any]:
    """One epoch of `LogsMetrics` over ``SAMPLES`` samples (the last batch ragged); rank 0 returns its metrics.csv rows."""
    torch.manual_seed(0)
    directory = Path(tempfile.mkdtemp()) if int(os.environ.get("LOCAL_RANK", 0)) == 0 else Path(tempfile.gettempdir())
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_epochs=1, logger=CSVLogger(directory, name="run", version=0),
        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    train = DataLoader(TokenDataset(SAMPLES, seed=1), batch_size=REPLICA_BATCH, shuffle=False)
    torch.manual_seed(0)
    trainer.fit(LogsMetrics(GPTConfig.small()), train)
    if trainer.global_rank != 0:
        return {"rows": []}
    with open(directory / "run" / "version_0" / "metrics.csv", newline="") as file:
        return {"rows": list(csv.DictReader(file))}


def ragged_worker(rank: int, world_size: int, runs: list[tuple[str, str]]) -> dict[str, dict[str, Any]]:
    """For every (strategy, kind) in turn, in one process group: ``ragged_fit`` (kind "fixed" or "varying",
    the sequence length) or ``metrics_fit`` (kind "metrics")."""
    torch.set_num_threads(1)
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    results = {}
    for strategy, kind in runs:
        key = strategy + ("" if kind == "fixed" else f"_{kind}")
        results[key] = metrics_fit(strategy, world_size) if kind == "metrics" else ragged_fit(strategy, world_size, kind == "varying")
    return results
