"""Workers for ``test_strategy_buffers.py``: modules whose training_step writes buffers, fit under ddp and nnscaler."""

from __future__ import annotations

import os
from contextlib import ExitStack
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import lightning_nnscaler  # noqa: F401 - registers the strategies
import lightning.pytorch as L  # noqa: E402

ROWS_PER_RANK, STEPS = 4, 4


class BatchNormNet(L.LightningModule):
    """A small CNN with BatchNorm2d (running statistics written every step), SGD."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2), nn.AdaptiveAvgPool2d(1))
        self.classifier = nn.Linear(8, 4)
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.classifier(self.features(x).flatten(1)), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        accuracy = (self.classifier(self.features(x).flatten(1)).argmax(1) == y).float().mean()
        self.log("val_acc", accuracy, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class CountingNet(L.LightningModule):
    """An EMA of the batch mean and a counter of samples seen, written in the step."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 1)
        self.register_buffer("ema", torch.zeros(()))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.ema.mul_(0.9).add_(0.1 * x.mean())
        self.seen += x.shape[0]
        return F.mse_loss(self.layer(x).squeeze(1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _gloo_sync_batch_norm(self: nn.SyncBatchNorm, input: torch.Tensor) -> torch.Tensor:
    """``nn.SyncBatchNorm.forward`` on CPU tensors for the ddp reference: torch's refuses them ("SyncBatchNorm expected
    input tensor to be on GPU"). The same exchange: per-channel sums, sums of squares and counts all-reduced over the
    world (differentiable: its backward all-reduces the gradients), the global mean and biased variance to normalize,
    the unbiased variance with the global count for the running variance."""
    if not self.training:
        return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
    self.num_batches_tracked.add_(1)
    dims, channels = [0, *range(2, input.dim())], input.shape[1]
    count = torch.tensor([input.numel() // channels], dtype=input.dtype)
    sums = torch.distributed.nn.functional.all_reduce(torch.cat([input.sum(dims), (input * input).sum(dims), count]))
    total = sums[-1]
    mean = sums[:channels] / total
    variance = sums[channels : 2 * channels] / total - mean * mean
    with torch.no_grad():
        self.running_mean.mul_(1 - self.momentum).add_(self.momentum * mean)
        self.running_var.mul_(1 - self.momentum).add_(self.momentum * variance * total / (total - 1))
    shape = [channels] + [1] * (input.dim() - 2)
    return (input - mean.view(shape)) * torch.rsqrt(variance.view(shape) + self.eps) * self.weight.view(shape) + self.bias.view(shape)


class _Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(trainer.callback_metrics.get("train_loss", torch.tensor(float("nan")))))


def _data(model: str, world_size: int) -> tuple[TensorDataset, TensorDataset]:
    generator = torch.Generator().manual_seed(3)
    rows = ROWS_PER_RANK * world_size * STEPS
    if model in ("bn", "syncbn"):
        images = torch.randn(rows, 3, 8, 8, generator=generator) * 2 + 1
        return TensorDataset(images, torch.randint(0, 4, (rows,), generator=generator)), TensorDataset(images[:16], torch.randint(0, 4, (16,), generator=generator))
    x = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3) / rows
    return TensorDataset(x, x.sum(1)), TensorDataset(x[:8], x[:8].sum(1))


def fit(strategy: str, model: str, world_size: int) -> dict[str, Any]:
    """Fit ``model`` ("bn", "syncbn": BatchNormNet with ``Trainer(sync_batchnorm=True)``, or "counting") for ``STEPS``
    steps; this rank's losses, buffers and validation accuracy."""
    torch.manual_seed(0)
    module = CountingNet() if model == "counting" else BatchNormNet()
    train, val = _data(model, world_size)
    recorder = _Losses()
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=world_size, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=[recorder],
        sync_batchnorm=model == "syncbn",
    )
    with ExitStack() as reference:
        if strategy == "ddp":  # torch's SyncBatchNorm and DDP's check of it refuse CPU modules
            reference.enter_context(mock.patch.object(nn.SyncBatchNorm, "forward", _gloo_sync_batch_norm))
            reference.enter_context(mock.patch.object(DistributedDataParallel, "_passing_sync_batchnorm_handle", lambda self, module: None))
        trainer.fit(module, DataLoader(train, batch_size=ROWS_PER_RANK, shuffle=True))
    validated = model != "counting"
    accuracy = float(trainer.validate(module, DataLoader(val, batch_size=ROWS_PER_RANK), verbose=False)[0]["val_acc"]) if validated else None
    buffers = {key: value.detach().clone() for key, value in module.named_buffers()}
    return {"losses": recorder.losses, "buffers": buffers, "val_acc": accuracy}


def buffer_worker(rank: int, world_size: int, runs: list[tuple[str, str]]) -> dict[str, Any]:
    """Every ``(strategy, model)`` fit in turn in one process group."""
    torch.set_num_threads(1)
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    return {f"{model} {strategy}": fit(strategy, model, world_size) for strategy, model in runs}
