"""Trainer runs shared by the e2e tests (module-level, so spawned and re-launched processes import them).

The same GPT reference model and data are trained with ``strategy="ddp"`` and with
``NnScalerStrategy``. A DDP rank loads ``global_batch / world_size`` samples per step (its
DistributedSampler takes every ``world_size``-th sample), while every nnscaler rank loads the whole
global batch (``num_replicas=1``) and its generated code slices its share: both see the same
samples per step, and DDP's gradient average equals our whole-batch mean loss's gradient.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

import lightning_nnscaler as lnn  # noqa: F401 - before lightning (keeps torchvision importable)

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from lightning_nnscaler.models.gpt import GPT, GPTConfig  # noqa: E402

GLOBAL_BATCH = 4
STEPS = 5
LEARNING_RATE = 1e-3


class TokenDataset(Dataset):
    """``size`` GPT samples (tokens, targets), each of ``seq_len`` tokens, fixed by ``seed``."""

    def __init__(self, size: int, seed: int = 0) -> None:
        config = GPTConfig.small()
        sequence = torch.randint(0, config.vocab_size, (size, config.seq_len + 1), generator=torch.Generator().manual_seed(seed))
        self.tokens, self.targets = sequence[:, :-1].contiguous(), sequence[:, 1:].contiguous()

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[index], self.targets[index]


class ScheduledGPT(GPT):
    """The GPT reference with what real training code has: two param groups, a warm-up LR schedule,
    and losses logged with ``sync_dist=True``."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.compute_loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.compute_loss(batch)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        decay = [parameter for parameter in self.parameters() if parameter.dim() >= 2]
        no_decay = [parameter for parameter in self.parameters() if parameter.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=LEARNING_RATE
        )
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


class LossRecorder(Callback):
    """Per batch: the loss averaged over ranks, and the LR of the first param group."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.learning_rates: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        # A DDP rank's loss is its half batch's: the mean over ranks is the global batch's loss.
        self.losses.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))
        self.learning_rates.append(trainer.optimizers[0].param_groups[0]["lr"])


class OneThreadPerRank(Callback):
    """Ranks share the machine's cores: more intra-op threads per rank only contend."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        torch.set_num_threads(1)


def build_model() -> ScheduledGPT:
    """The same initial weights in every process."""
    torch.manual_seed(0)
    return ScheduledGPT(GPTConfig.small())


def fit_gpt(
    strategy: Any, *, devices: int, steps: int = STEPS, accumulate: int = 1, clip: float | None = None, validate: bool = True,
    samples: int | None = None, checkpoint_dir: str | None = None, resume_from: str | None = None, **trainer_kwargs: Any,
) -> dict[str, Any]:
    """Train up to ``steps`` optimizer steps (each ``accumulate`` batches of ``GLOBAL_BATCH`` samples), then validate.

    Args:
        samples: Samples per epoch; by default exactly ``steps`` optimizer steps' worth.
        checkpoint_dir: Save a checkpoint there at the end of every epoch (``ModelCheckpoint``).
        resume_from: Resume training from that checkpoint (``trainer.fit(ckpt_path=...)``).

    Returns:
        The per-batch losses and LRs, the last logged train_loss, the validation loss and the final full weights.
    """
    global_samples = isinstance(strategy, lnn.NnScalerStrategy) or (isinstance(strategy, str) and strategy.startswith("nnscaler"))
    batch_size = GLOBAL_BATCH if global_samples else GLOBAL_BATCH // devices
    samples = samples or GLOBAL_BATCH * steps * accumulate
    train = DataLoader(TokenDataset(samples, seed=1), batch_size=batch_size, shuffle=True, drop_last=True)
    val = DataLoader(TokenDataset(2 * GLOBAL_BATCH, seed=2), batch_size=batch_size)
    recorder = LossRecorder()
    checkpoints = [ModelCheckpoint(dirpath=checkpoint_dir, save_top_k=-1, every_n_epochs=1)] if checkpoint_dir else []
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=steps, accumulate_grad_batches=accumulate,
        gradient_clip_val=clip, logger=False, enable_checkpointing=bool(checkpoint_dir), enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[recorder, *checkpoints], **trainer_kwargs,
    )
    model = build_model()
    trainer.fit(model, train, val, ckpt_path=resume_from)  # validates at each epoch's end, mid-training too
    train_loss = float(trainer.callback_metrics["train_loss"])
    val_loss = float(trainer.validate(model, val, verbose=False)[0]["val_loss"]) if validate else None
    state = {key: value.detach().clone() for key, value in model.state_dict().items()}
    return {"losses": recorder.losses, "learning_rates": recorder.learning_rates, "train_loss": train_loss, "val_loss": val_loss, "state": state}


def parity_worker(rank: int, world_size: int, runs: list[tuple[str, Any, dict[str, Any]]]) -> dict[str, Any]:
    """Run every ``(label, strategy, options)`` in turn in one process group, as torchrun would start them.

    ``LOCAL_RANK`` tells Lightning the processes exist already (no launcher); the group made by
    ``runtime.launch`` is reused by every Trainer.
    """
    torch.set_num_threads(1)  # two ranks share the cores: more intra-op threads only contend
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    return {label: fit_gpt(strategy, devices=world_size, **options) for label, strategy, options in runs}


def single_device_run(steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Eager training in this process with the same model, data order, optimizer and LR schedule
    (no Trainer): the per-step losses and the final weights."""
    model = build_model()
    model.log = lambda *args, **kwargs: None
    optimizer_config = model.configure_optimizers()
    optimizer, scheduler = optimizer_config["optimizer"], optimizer_config["lr_scheduler"]["scheduler"]
    dataset = TokenDataset(GLOBAL_BATCH * steps, seed=1)
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0)).tolist()  # DistributedSampler's, seed 0
    losses = []
    for step in range(steps):
        indices = order[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]
        optimizer.zero_grad()
        loss = model.training_step((dataset.tokens[indices], dataset.targets[indices]), step)
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses, {key: value.detach().clone() for key, value in model.state_dict().items()}


def main(strategy: str, devices: int, output: str) -> None:
    """Script entry: ``python lightning_runs.py STRATEGY DEVICES OUTPUT.json`` (Lightning re-runs it per device)."""
    torch.set_num_threads(1)
    result = fit_gpt(strategy, devices=devices, validate=False)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        Path(output).write_text(json.dumps({"losses": result["losses"], "train_loss": result["train_loss"]}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
