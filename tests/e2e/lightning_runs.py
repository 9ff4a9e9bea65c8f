"""Trainer runs shared by the e2e tests (module-level, so spawned and re-launched processes import them).

The same model and data are trained with ``strategy="ddp"`` and with
``NnScalerStrategy``. As under DDP, the DataLoader's ``batch_size`` is per data-parallel replica:
a DDP rank is a replica; under nnscaler the recipe's layout says how many replicas there are (dp:
every rank; tp over all ranks: one). `replica_batch_size` gives each the same global batch
(``GLOBAL_BATCH``), so both see the same samples per step, and DDP's gradient average equals our
whole-batch mean loss's gradient.

Two models: the GPT reference (``model="gpt"``) and `ConvClassifier` (``model="conv"``), a plain
module with a conv stem and an MLP head and no attention, trained with SGD + momentum.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import lightning_nnscaler as lnn  # noqa: F401 - registers the strategies

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from lightning_nnscaler.models.evoformer import Evoformer, EvoformerConfig  # noqa: E402
from lightning_nnscaler.models.gpt import GPT, GPTConfig  # noqa: E402

GLOBAL_BATCH = 4
STEPS = 5
LEARNING_RATE = 1e-3
CONV_LEARNING_RATE = 0.1
SIGNAL_CHANNELS, SIGNAL_LENGTH, CLASSES = 3, 16, 10  # ConvClassifier's input (B, 3, 16), 10 classes
EVOFORMER = dataclasses.replace(EvoformerConfig.small(), recycles=3)  # two no-grad recycling passes, then the gradient pass


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


class SyncLoggedSteps:
    """training_step / validation_step that return ``compute_loss`` and log it with ``sync_dist=True``."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """The batch's loss, logged as train_loss."""
        loss = self.compute_loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """The batch's loss, logged as val_loss."""
        loss = self.compute_loss(batch)
        self.log("val_loss", loss, sync_dist=True)
        return loss


class ScheduledGPT(SyncLoggedSteps, GPT):
    """The GPT reference with what real training code has: two param groups, a warm-up LR schedule,
    and losses logged with ``sync_dist=True``."""

    def configure_optimizers(self) -> Any:
        decay = [parameter for parameter in self.parameters() if parameter.dim() >= 2]
        no_decay = [parameter for parameter in self.parameters() if parameter.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=LEARNING_RATE
        )
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


class RecyclingDataset(Dataset):
    """``size`` Evoformer samples (MSA features, distogram bins) of ``EVOFORMER`` shape, fixed by ``seed``."""

    def __init__(self, size: int, seed: int = 0) -> None:
        torch.manual_seed(0)
        self.features, self.bins = Evoformer(EVOFORMER).example_batch(size, torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.features[index], self.bins[index]


class ScheduledEvoformer(SyncLoggedSteps, Evoformer):
    """The Evoformer reference with recycling (3 passes: two under no_grad), AdamW and a warm-up LR schedule."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=LEARNING_RATE)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


class SignalDataset(Dataset):
    """``size`` signals ``(SIGNAL_CHANNELS, SIGNAL_LENGTH)``, each labelled by the arg-max of a fixed
    random projection of it (a rule the model can learn), fixed by ``seed``.

    Amplitude 3 (not 1) lifts `ConvClassifier`'s gradient norm to about 2 (1.7-2.9 over 20 steps), so
    that ``gradient_clip_val=1.0`` rescales every step (about 0.6-1.0 at amplitude 1: none).
    """

    def __init__(self, size: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.signals = 3.0 * torch.randn(size, SIGNAL_CHANNELS, SIGNAL_LENGTH, generator=generator)
        projection = torch.randn(SIGNAL_CHANNELS * SIGNAL_LENGTH, CLASSES, generator=torch.Generator().manual_seed(99))
        self.labels = (self.signals.flatten(1) @ projection).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.signals)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.signals[index], self.labels[index]


class ConvClassifier(SyncLoggedSteps, L.LightningModule):
    """A plain classifier without attention: Conv1d -> GELU -> flatten -> Linear -> GELU -> Linear ->
    cross-entropy; SGD with momentum over two param groups and a step-wise StepLR schedule.

    Sizes divide every split at 2 ranks: 8 conv channels, an MLP hidden of 32 (co-shard: 4 pieces of 8).
    """

    def __init__(self, conv_channels: int = 8, hidden: int = 32) -> None:
        super().__init__()
        self.conv = nn.Conv1d(SIGNAL_CHANNELS, conv_channels, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(conv_channels * SIGNAL_LENGTH, hidden)
        self.fc2 = nn.Linear(hidden, CLASSES)

    def forward(self, signals: torch.Tensor) -> torch.Tensor:
        """Signals (B, C, L) -> class logits (B, CLASSES)."""
        features = F.gelu(self.conv(signals)).flatten(1)  # (B, conv_channels * L)
        return self.fc2(F.gelu(self.fc1(features)))

    def compute_loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Mean cross-entropy over the batch."""
        signals, labels = batch
        return F.cross_entropy(self(signals), labels)

    def configure_optimizers(self) -> Any:
        """SGD + momentum: the conv at half the MLP's LR; the LR halves every 5 optimizer steps."""
        conv, mlp = list(self.conv.parameters()), [*self.fc1.parameters(), *self.fc2.parameters()]
        optimizer = torch.optim.SGD(
            [{"params": mlp, "weight_decay": 1e-4}, {"params": conv, "lr": 0.5 * CONV_LEARNING_RATE}],
            lr=CONV_LEARNING_RATE, momentum=0.9,
        )
        halving = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": halving, "interval": "step"}}


class StepRecorder(Callback):
    """Per batch: the loss averaged over ranks and the LR of the first param group; per optimizer
    step, the gradients' global 2-norm before clipping (only where the module's own parameters
    hold whole gradients, as under DDP: an nnscaler rank's optimizer steps its pieces instead)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.learning_rates: list[float] = []
        self.gradient_norms: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        # A DDP rank's loss is its half batch's: the mean over ranks is the global batch's loss.
        self.losses.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))
        self.learning_rates.append(trainer.optimizers[0].param_groups[0]["lr"])

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer) -> None:
        # Lightning calls this hook after the (accumulated, DDP-averaged) backward, before clipping.
        if isinstance(trainer.strategy, lnn.NnScalerStrategy):
            return
        gradients = [parameter.grad for parameter in pl_module.parameters() if parameter.grad is not None]
        self.gradient_norms.append(float(torch.linalg.vector_norm(torch.stack([gradient.norm() for gradient in gradients]))))


class OneThreadPerRank(Callback):
    """Ranks share the machine's cores: more intra-op threads per rank only contend."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        torch.set_num_threads(1)


def build_model() -> ScheduledGPT:
    """The same initial weights in every process."""
    torch.manual_seed(0)
    return ScheduledGPT(GPTConfig.small())


def build_conv_model() -> ConvClassifier:
    """The same initial weights in every process."""
    torch.manual_seed(0)
    return ConvClassifier()


def build_recycling_model() -> ScheduledEvoformer:
    """The same initial weights in every process."""
    torch.manual_seed(0)
    return ScheduledEvoformer(EVOFORMER)


def build_deep_model() -> ScheduledGPT:
    """GPT.small's widths with 8 blocks (a block per stage of a V-shaped pipeline on 4 ranks)."""
    torch.manual_seed(0)
    return ScheduledGPT(dataclasses.replace(GPTConfig.small(), layers=8))


MODELS = {
    "gpt": (build_model, TokenDataset), "gpt8": (build_deep_model, TokenDataset), "conv": (build_conv_model, SignalDataset),
    "evoformer": (build_recycling_model, RecyclingDataset),
}
"""Model name -> (model builder, dataset class ``(size, seed)``)."""


def replica_batch_size(strategy: Any, devices: int, global_batch: int = GLOBAL_BATCH) -> int:
    """The DataLoader ``batch_size`` that makes ``global_batch`` samples per step under ``strategy``:
    ``global_batch`` / its data-parallel replicas (DDP's: ``devices``; nnscaler's: the recipe's layout)."""
    strategy = make_strategy(strategy)
    if isinstance(strategy, lnn.NnScalerStrategy):
        recipe, params = strategy.recipe, strategy.recipe_params
    elif isinstance(strategy, str) and strategy.startswith("nnscaler"):
        recipe, params = strategy.removeprefix("nnscaler").removeprefix("_") or "dp", {}
        recipe = "dp" if recipe == "spawn" else recipe
    else:
        return global_batch // devices
    return global_batch // lnn.load_recipe(recipe).layout(devices, params).data_parallel


def make_strategy(strategy: str | dict[str, Any] | Any) -> Any:
    """A Trainer ``strategy``: a registered name, an ``NnScalerStrategy``, or a dict of its arguments
    (``{"recipe": "coshard", "shards": 2}``: picklable, so it crosses process launches)."""
    return lnn.NnScalerStrategy(**strategy) if isinstance(strategy, dict) else strategy


def fit(
    strategy: Any, *, model: str = "gpt", devices: int, steps: int = STEPS, accumulate: int = 1, clip: float | None = None,
    validate: bool = True, samples: int | None = None, checkpoint_dir: str | None = None, resume_from: str | None = None,
    init: str = "eager", compile_backend: str | None = None, **trainer_kwargs: Any,
) -> dict[str, Any]:
    """Train ``model`` (a key of `MODELS`) up to ``steps`` optimizer steps (each ``accumulate``
    batches of ``GLOBAL_BATCH`` samples), then validate.

    Args:
        strategy: See `make_strategy`.
        samples: Samples per epoch; by default exactly ``steps`` optimizer steps' worth.
        checkpoint_dir: Save a checkpoint there at the end of every epoch (``ModelCheckpoint``).
        resume_from: Resume training from that checkpoint (``trainer.fit(ckpt_path=...)``).
        init: ``"eager"`` builds the model as it is; ``"init_module"`` builds it under ``trainer.init_module()``
            (on meta under nnscaler: the state returned is then ``strategy.full_state_dict()``, and ``on_meta`` says
            whether the module the user holds stayed on meta after the fit and validation).
        compile_backend: Hand the Trainer ``torch.compile(model, backend=compile_backend)`` instead of the model.

    Returns:
        The per-batch losses (as Lightning hands them to ``on_train_batch_end``: divided by
        ``accumulate``) and LRs, the per-step gradient norms before clipping (DDP only), the last
        logged train_loss, the validation loss, the final full weights and, under nnscaler, the
        parameter ``boxes`` this rank holds and the plan's ``reads`` (see `parameter_reads`), and whether the
        executor ran compiled segments (``compiled_segments``).
    """
    strategy = make_strategy(strategy)
    build, dataset = MODELS[model]
    batch_size = replica_batch_size(strategy, devices * trainer_kwargs.get("num_nodes", 1))
    samples = samples or GLOBAL_BATCH * steps * accumulate
    train = DataLoader(dataset(samples, seed=1), batch_size=batch_size, shuffle=True, drop_last=True)
    val = DataLoader(dataset(2 * GLOBAL_BATCH, seed=2), batch_size=batch_size)
    recorder = StepRecorder()
    checkpoints = [ModelCheckpoint(dirpath=checkpoint_dir, save_top_k=-1, every_n_epochs=1)] if checkpoint_dir else []
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=steps, accumulate_grad_batches=accumulate,
        gradient_clip_val=clip, logger=False, enable_checkpointing=bool(checkpoint_dir), enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[recorder, *checkpoints], **trainer_kwargs,
    )
    if init == "init_module":
        with trainer.init_module():
            module = build()
    else:
        module = build()
    trainer.fit(torch.compile(module, backend=compile_backend) if compile_backend else module, train, val, ckpt_path=resume_from)
    boxes, reads = held_boxes(trainer.strategy), parameter_reads(getattr(trainer.strategy, "plan", None))
    train_loss = float(trainer.callback_metrics["train_loss"])
    val_loss = float(trainer.validate(module, val, verbose=False)[0]["val_loss"]) if validate else None
    on_meta = any(tensor.is_meta for tensor in module.state_dict().values())
    if on_meta:
        state = trainer.strategy.full_state_dict(rank=0)
    else:
        state = {key: value.detach().clone() for key, value in module.state_dict().items()}
    return {
        "losses": recorder.losses, "learning_rates": recorder.learning_rates, "gradient_norms": recorder.gradient_norms,
        "train_loss": train_loss, "val_loss": val_loss, "state": state, "boxes": boxes, "reads": reads, "on_meta": on_meta,
        "bytes_read": getattr(trainer.strategy, "bytes_read", None),
        "compiled_segments": getattr(getattr(trainer.strategy, "executor", None), "segments", None) is not None,
    }


def held_boxes(strategy: Any) -> dict[str, list[tuple[tuple[int, int], ...]]]:
    """The parameter boxes (per dim ``(start, stop)``) an nnscaler rank holds, by state_dict key; {} otherwise."""
    executor = getattr(strategy, "executor", None)
    boxes: dict[str, list[tuple[tuple[int, int], ...]]] = {}
    for shard in executor.shards.values() if executor is not None else ():
        boxes.setdefault(shard.location.state_key, []).append(shard.location.box)
    return boxes


def parameter_reads(plan: Any) -> dict[str, list[tuple[int, tuple[tuple[int, int], ...], int | None]]]:
    """Per state_dict key, every planned op piece that reads the parameter: (device, the box it reads,
    its recompute group); {} without a plan."""
    reads: dict[str, list[tuple[int, tuple[tuple[int, int], ...], int | None]]] = {}
    for op in plan.planned.ops if plan is not None else ():
        for piece in op.tensor_inputs:
            if piece.tensor.role == "parameter":
                reads.setdefault(piece.tensor.state_key, []).append((op.device, tuple(piece.index.ranges), op.recompute))
    return reads


def fit_gpt(strategy: Any, *, devices: int, **options: Any) -> dict[str, Any]:
    """`fit` the GPT reference (every `fit` keyword works)."""
    return fit(strategy, model="gpt", devices=devices, **options)


def parity_worker(rank: int, world_size: int, runs: list[tuple[str, Any, dict[str, Any]]]) -> dict[str, Any]:
    """Run every ``(label, strategy, fit options)`` in turn in one process group, as torchrun would start them.

    ``LOCAL_RANK`` tells Lightning the processes exist already (no launcher); the group made by
    ``runtime.launch`` is reused by every Trainer.
    """
    torch.set_num_threads(1)  # two ranks share the cores: more intra-op threads only contend
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    return {label: fit(strategy, devices=world_size, **options) for label, strategy, options in runs}


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
