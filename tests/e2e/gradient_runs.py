"""Data-parallel fits that look at where the gradients live and when the optimizer steps (module-level,
so launched processes import it): ``strategy="ddp"`` vs ``NnScalerStrategy(recipe="dp")`` with and
without the overlapped optimizer step, on the GPT reference (two AdamW param groups, a warm-up LR
schedule), no hook that reads gradients (so the overlap is allowed unless clipping turns it off).
"""

from __future__ import annotations

import os
from typing import Any

import torch

import lightning_nnscaler as lnn  # noqa: F401 - registers the strategies

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_runs import GLOBAL_BATCH, TokenDataset, build_model, make_strategy, replica_batch_size  # noqa: E402

SMALL_BUCKETS_MB = 0.05  # GPTConfig.small()'s gradients (about 0.3 MiB) in several buckets, so that sums are still in flight when backward ends


class LossRecorder(Callback):
    """The global batch's loss per batch (the mean over ranks of what each rank returns). Overrides no
    gradient hook, so it does not turn the overlapped optimizer step off."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))


def gradient_storage(strategy: Any) -> dict[str, Any]:
    """Where an nnscaler rank's replicated gradients live: whether each is a view of its bucket's one
    buffer, and the bytes of the buckets and of the gradients."""
    reducer = strategy.executor.reducer
    buckets = list(reducer._buckets)
    views = []
    for bucket in buckets:
        storage = bucket.buffer.untyped_storage().data_ptr()
        views += [parameter.grad is not None and parameter.grad.untyped_storage().data_ptr() == storage for parameter in bucket.parameters]
    return {
        "buckets": len(buckets), "all_views": bool(views) and all(views),
        "bucket_bytes": sum(bucket.buffer.numel() * bucket.buffer.element_size() for bucket in buckets),
        "gradient_bytes": sum(parameter.numel() * parameter.element_size() for bucket in buckets for parameter in bucket.parameters),
        "bucket_sizes": [bucket.buffer.numel() * bucket.buffer.element_size() for bucket in buckets],
        "simulated_bucket_sizes": simulated_bucket_sizes(strategy),
    }


def simulated_bucket_sizes(strategy: Any) -> list[int]:
    """The bytes of each gradient sum the simulator prices for this rank's step (what the predicted step logged to W&B runs)."""
    from lightning_nnscaler.sim.costs import Roofline
    from lightning_nnscaler.sim.from_plan import plan_task_lists
    from lightning_nnscaler.sim.predict import DeviceModel
    from lightning_nnscaler.sim.specs import load_spec

    plan = strategy.plan
    spec = load_spec("cpu")
    tasks = plan_task_lists(plan, DeviceModel(spec, Roofline(spec)).for_ranks(plan.world_size))[strategy.global_rank]
    return [task.nbytes for task in tasks if task.label.startswith("REDUCE")]


def fit(strategy: Any, *, devices: int, steps: int, accumulate: int = 1, clip: float | None = None) -> dict[str, Any]:
    """Train the GPT reference ``steps`` optimizer steps; losses, final weights and, under nnscaler,
    the gradient storage, the overlap's reasons to be off and its bucket steps."""
    strategy = make_strategy(strategy)
    batch_size = replica_batch_size(strategy, devices)
    train = DataLoader(TokenDataset(GLOBAL_BATCH * steps * accumulate, seed=1), batch_size=batch_size, shuffle=True, drop_last=True)
    recorder = LossRecorder()
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=steps, accumulate_grad_batches=accumulate,
        gradient_clip_val=clip, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=[recorder],
    )
    module = build_model()
    trainer.fit(module, train)
    result: dict[str, Any] = {"losses": recorder.losses, "state": {key: value.detach().clone() for key, value in module.state_dict().items()}}
    if isinstance(trainer.strategy, lnn.NnScalerStrategy):
        result.update(
            gradient_storage(trainer.strategy), off_reasons=trainer.strategy.overlap_off_reasons,
            bucket_steps=trainer.strategy._overlap.bucket_steps if trainer.strategy._overlap is not None else 0,
        )
    return result


def worker(rank: int, world_size: int, runs: list[tuple[str, Any, dict[str, Any]]]) -> dict[str, Any]:
    """Every ``(label, strategy, fit options)`` in turn in the launched process group (as torchrun would start them)."""
    torch.set_num_threads(1)
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    return {label: fit(strategy, devices=world_size, **options) for label, strategy, options in runs}
