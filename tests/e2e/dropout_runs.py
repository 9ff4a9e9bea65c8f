"""GPT with dropout 0.1 trained under several plans in one process group (module-level, so launched
processes import it): every plan must draw the same masks, so the losses agree step by step."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Iterator

import torch

import lightning_nnscaler  # noqa: F401 - registers the strategies

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, Sampler  # noqa: E402

from lightning_nnscaler.models.gpt import GPTConfig  # noqa: E402
from lightning_runs import ScheduledGPT, StepRecorder, TokenDataset  # noqa: E402

GLOBAL_BATCH = 4
STEPS_PER_EPOCH = 5
SEED = 7


class ReplicaRows(Sampler):
    """Replica ``replica``'s rows of each global batch, in order: the whole batch of step s is samples
    ``4s .. 4s+3`` under every plan (dp: replica 0 the first two, replica 1 the last two; a plan with
    one replica: all four), so every plan's random ops draw for the same rows."""

    def __init__(self, size: int, replica: int, replicas: int) -> None:
        rows = GLOBAL_BATCH // replicas
        self.indices = [start + replica * rows + row for start in range(0, size, GLOBAL_BATCH) for row in range(rows)]

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)


def dropout_fit(strategy: str, devices: int, directory: str, epochs: int, resume: str | None = None, dropout: float = 0.1) -> list[float]:
    """``epochs`` epochs of ``STEPS_PER_EPOCH`` steps of GPT with dropout 0.1; the per-step losses (whole batch).

    A checkpoint is saved at every epoch's end under ``directory/strategy``; ``resume`` names one to start from.
    """
    L.seed_everything(SEED, verbose=False)
    replicas = devices if strategy in ("ddp", "nnscaler", "nnscaler_dp") else 1
    samples = TokenDataset(GLOBAL_BATCH * STEPS_PER_EPOCH, seed=1)
    replica = int(os.environ.get("LOCAL_RANK", 0)) if replicas > 1 else 0
    sampler = ReplicaRows(len(samples), replica, replicas)
    train = DataLoader(samples, batch_size=GLOBAL_BATCH // replicas, sampler=sampler, drop_last=True)
    recorder = StepRecorder()
    checkpoints = ModelCheckpoint(dirpath=str(Path(directory) / strategy), every_n_epochs=1, save_top_k=-1, filename="{epoch}")
    # coshard: 2 shards x 2 devices divide the 4 heads (its default of 4 shards would not)
    chosen = lightning_nnscaler.NnScalerStrategy(recipe="coshard", shards=2) if strategy == "nnscaler_coshard" else strategy
    trainer = L.Trainer(
        strategy=chosen, accelerator="cpu", devices=devices, max_epochs=epochs, logger=False, enable_progress_bar=False,
        use_distributed_sampler=False,
        enable_model_summary=False, callbacks=[recorder, checkpoints],
    )
    torch.manual_seed(0)
    model = ScheduledGPT(dataclasses.replace(GPTConfig.small(), dropout=dropout))
    trainer.fit(model, train, ckpt_path=resume)
    return recorder.losses


def dropout_worker(rank: int, world_size: int, directory: str) -> dict[str, list[float]]:
    """dp, tp and coshard for two epochs (10 steps), then dp resumed from its epoch-0 checkpoint (step 5)."""
    torch.set_num_threads(1)
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    runs = {strategy: dropout_fit(strategy, world_size, directory, 2) for strategy in ("nnscaler", "nnscaler_tp", "nnscaler_coshard")}
    saved = str(Path(directory) / "nnscaler" / "epoch=0.ckpt")
    runs["nnscaler resumed"] = dropout_fit("nnscaler", world_size, directory + "/resumed", 2, resume=saved)
    return runs
