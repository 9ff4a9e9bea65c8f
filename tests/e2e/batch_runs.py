"""An unchanged ddp-style script (one DataLoader, ``batch_size`` per data-parallel replica) run under
several strategies in one process group (module-level, so launched processes import it)."""

from __future__ import annotations

import os
from typing import Any

import torch

import lightning_nnscaler  # noqa: F401 - registers the strategies

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_nnscaler.plans.megatron_tp import tensor_parallel  # noqa: E402
from lightning_nnscaler.plans.propagate import place  # noqa: E402
from lightning_runs import TokenDataset, build_model  # noqa: E402



@lightning_nnscaler.register_recipe(name="user_tp", summary="A user's Megatron split over every rank.")
def user_tp(graph: lightning_nnscaler.Graph, ctx: lightning_nnscaler.PlanContext) -> None:
    """A user's own recipe, registered at import: Trainer(strategy="nnscaler_user_tp") finds it."""
    place(graph, tensor_parallel(graph, ctx.world_size), range(ctx.world_size))


REPLICA_BATCH = 2
STEPS = 10


class BatchRecorder(Callback):
    """Per step: the logged ``train_loss`` (``sync_dist=True``) and this rank's batch (its tokens)."""

    def __init__(self) -> None:
        self.logged: list[float] = []
        self.batches: list[list[list[int]]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.logged.append(float(trainer.callback_metrics["train_loss"]))
        self.batches.append(batch[0].tolist())


def ddp_style_fit(strategy: str, devices: int) -> dict[str, Any]:
    """The same script for every strategy: only ``strategy`` changes."""
    torch.manual_seed(0)
    recorder = BatchRecorder()
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder],
    )
    train = DataLoader(TokenDataset(REPLICA_BATCH * devices * STEPS, seed=1), batch_size=REPLICA_BATCH, shuffle=True, drop_last=True)
    trainer.fit(build_model(), train)
    sampler = trainer.train_dataloader.sampler
    return {
        "logged": recorder.logged, "batches": recorder.batches,
        "sampler": {"num_replicas": sampler.num_replicas, "rank": sampler.rank},
    }


def batches_worker(rank: int, world_size: int, strategies: list[str]) -> dict[str, dict[str, Any]]:
    """``ddp_style_fit`` for every strategy in turn, in one process group (as torchrun starts them)."""
    torch.set_num_threads(1)
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    return {strategy: ddp_style_fit(strategy, world_size) for strategy in strategies}
