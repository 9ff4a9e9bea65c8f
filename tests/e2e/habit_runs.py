"""Ordinary Lightning habits in a training_step, trained under ddp and under nnscaler on the same ranks
(``test_strategy_habits``): a warm-up factor written with the numbers on the left, logging every other
batch by ``batch_idx``, ``self.log(name, loss.item())``, the step number logged, and torchmetrics
``Accuracy`` and ``MeanMetric`` updated and logged from the step."""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_nnscaler  # noqa: F401 - registers the strategies

import lightning as L  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

BATCH_SIZE, BATCHES, EPOCHS = 4, 3, 2


class Habits(L.LightningModule):
    """A small MLP classifier whose step reads its step values and updates its metrics the way Lightning's docs write them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mlp = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        self.train_accuracy = torchmetrics.classification.Accuracy(task="multiclass", num_classes=3)
        self.mean_loss = torchmetrics.MeanMetric()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        logits = self.mlp(inputs)
        loss = F.cross_entropy(logits, targets)
        self.train_accuracy(logits, targets)
        self.log("train_accuracy", self.train_accuracy, on_step=True, on_epoch=True)
        self.mean_loss.update(loss)
        self.log("mean_loss", self.mean_loss, on_step=False, on_epoch=True)
        warm_up = min(1.0, (self.global_step + 1) / 4)
        scaled = loss * warm_up * 0.8**self.current_epoch
        if batch_idx % 2 == 0:
            self.log("sampled_loss", loss)
        self.log("loss_item", loss.item())
        self.log("step_seen", self.global_step)
        return scaled

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.2)


class RecordLogged(L.Callback):
    def __init__(self) -> None:
        self.logged: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.logged.append({key: float(value) for key, value in trainer.callback_metrics.items()})


def fit_habits(strategy: Any, world_size: int, folder: str) -> dict[str, Any]:
    """Fit `Habits` for ``EPOCHS`` epochs of ``BATCHES`` batches per rank; returns what rank 0 saw each batch,
    its CSV logger's rows and the final weights."""
    generator = torch.Generator().manual_seed(3)
    samples = BATCH_SIZE * BATCHES * world_size
    data = TensorDataset(torch.randn(samples, 6, generator=generator), torch.randint(0, 3, (samples,), generator=generator))
    recorder = RecordLogged()
    logger = CSVLogger(folder, name="habits", version=str(strategy))
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=world_size, max_epochs=EPOCHS, logger=logger, log_every_n_steps=1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=[recorder],
    )
    module = Habits()
    trainer.fit(module, DataLoader(data, batch_size=BATCH_SIZE, shuffle=True))
    rows: list[dict[str, str]] = []
    if trainer.global_rank == 0:
        with open(Path(logger.log_dir) / "metrics.csv") as file:
            rows = list(csv.DictReader(file))
    return {"logged": recorder.logged, "csv": rows, "state": {key: value.detach().clone() for key, value in module.state_dict().items()}}


def habits_worker(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """ddp, then nnscaler (dp), in one process group, as torchrun would start them."""
    torch.set_num_threads(1)
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    return {strategy: fit_habits(strategy, world_size, folder) for strategy in ("ddp", "nnscaler")}
