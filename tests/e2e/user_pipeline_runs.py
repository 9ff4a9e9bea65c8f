"""Trainer runs of user models under the pipeline strategies (module-level, so rank processes import them).

Four LightningModules written the way Hugging Face and timm users write them, each from a tiny config
with random weights: GPT-2 computing its own loss from ``labels=``, Qwen2 and timm's ConvNeXt giving
logits to ``F.cross_entropy``, and a CIFAR-style CNN with BatchNorm2d. Each logs its loss with a plain
``self.log("train_loss", loss)`` (no ``sync_dist``), as their docs do.

As in ``lightning_runs``, the DataLoader's ``batch_size`` is per data-parallel replica: a ddp rank is a
replica, a 2-stage pipeline over 2 ranks is one replica, and ``replica_batch_size`` gives both the same
``GLOBAL_BATCH`` samples per step (``DistributedSampler``'s permutation, seed 0).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import lightning_nnscaler as lnn  # noqa: F401 - registers the strategies

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.loggers import Logger  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from lightning_runs import replica_batch_size  # noqa: E402 - tests/e2e is on sys.path

GLOBAL_BATCH, STEPS = 4, 3
VOCAB, LENGTH, HIDDEN, HEADS, FFN, CLASSES = 64, 8, 32, 8, 64, 10
LEARNING_RATE = 1e-3


class TokenDataset(Dataset):
    """``size`` token sequences of ``LENGTH`` and their next tokens, fixed by ``seed``."""

    def __init__(self, size: int, seed: int = 1) -> None:
        sequence = torch.randint(0, VOCAB, (size, LENGTH + 1), generator=torch.Generator().manual_seed(seed))
        self.tokens, self.targets = sequence[:, :-1].contiguous(), sequence[:, 1:].contiguous()

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> Any:
        return self.tokens[index], self.targets[index]


class CausalLMDataset(TokenDataset):
    """What Hugging Face's ``DataCollatorForLanguageModeling(mlm=False)`` hands a causal LM: ``input_ids``
    and ``labels`` equal to them (the model shifts the labels itself)."""

    def __getitem__(self, index: int) -> Any:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index].clone()}


class ImageDataset(Dataset):
    """``size`` random images ``(3, side, side)`` and class labels, fixed by ``seed``."""

    def __init__(self, size: int, side: int, seed: int = 1) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.images, self.labels = torch.randn(size, 3, side, side, generator=generator), torch.randint(0, CLASSES, (size,), generator=generator)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]


class AdamWModule(L.LightningModule):
    """AdamW at ``LEARNING_RATE`` over every parameter, as the Hugging Face and timm examples train."""

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=LEARNING_RATE)


class GPT2LM(AdamWModule):
    """GPT2LMHeadModel (tied embeddings, ``Conv1D`` projections) computing its loss from ``labels=``."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=HEADS, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, attn_implementation="sdpa",
        )
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        self.log("train_loss", loss)
        return loss


class Qwen2LM(AdamWModule):
    """Qwen2ForCausalLM (rotary embeddings, grouped-query attention) whose logits go to ``F.cross_entropy``."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2, num_attention_heads=HEADS,
            num_key_value_heads=2, max_position_embeddings=32, attention_dropout=0.0, attn_implementation="sdpa",
        )
        self.model = Qwen2ForCausalLM(config)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        logits = self.model(input_ids=tokens).logits  # (B, T, VOCAB)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        self.log("train_loss", loss)
        return loss


class ConvNeXtClassifier(AdamWModule):
    """timm's ConvNeXt (``timm.create_model("convnext_atto", ...)``, narrowed: one block per stage, 16-64
    channels) on 32 x 32 images: depthwise 7 x 7 convs, channels-last LayerNorms, layer scale."""

    def __init__(self) -> None:
        super().__init__()
        import timm

        self.model = timm.create_model(
            "convnext_atto", pretrained=False, num_classes=CLASSES, drop_path_rate=0.0, depths=(1, 1, 1, 1), dims=(16, 32, 48, 64),
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = F.cross_entropy(self.model(images), labels)
        self.log("train_loss", loss)
        return loss


class BatchNormCNN(L.LightningModule):
    """A CIFAR-style CNN with BatchNorm2d, trained with SGD + momentum, on 16 x 16 images."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, CLASSES))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images))  # (B, CLASSES)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


MODELS: dict[str, tuple[type[L.LightningModule], Any]] = {
    "gpt2": (GPT2LM, lambda size: CausalLMDataset(size)),
    "qwen2": (Qwen2LM, lambda size: TokenDataset(size)),
    "convnext": (ConvNeXtClassifier, lambda size: ImageDataset(size, 32)),
    "bn_cnn": (BatchNormCNN, lambda size: ImageDataset(size, 16)),
}
"""Model name -> (LightningModule class, dataset of ``size`` samples)."""


def build(name: str) -> L.LightningModule:
    """Model ``name`` with the same random initial weights in every process."""
    torch.manual_seed(0)
    return MODELS[name][0]()


class LoggedValues(Logger):
    """Records what ``self.log`` hands the logger at every step, on every rank (loggers usually write on rank 0 only)."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "recorded"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.steps.append(dict(metrics))


class StepLosses(Callback):
    """Per step: the loss ``training_step`` returned, averaged over ranks (a ddp rank's is its half batch's)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))


def fit(strategy: str, model: str, devices: int) -> dict[str, Any]:
    """Train ``model`` ``STEPS`` steps of ``GLOBAL_BATCH`` samples under ``strategy`` on ``devices`` ranks.

    Returns:
        Per step the returned loss averaged over ranks (``losses``) and this rank's logged train_loss
        (``logged``), the final weights and buffers (``state``) and, under a pipeline, its microbatches per step.
    """
    dataset = MODELS[model][1](GLOBAL_BATCH * STEPS)
    loader = DataLoader(dataset, batch_size=replica_batch_size(strategy, devices, GLOBAL_BATCH), shuffle=True, drop_last=True)
    recorder, logger = StepLosses(), LoggedValues()
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=STEPS, logger=logger, log_every_n_steps=1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=[recorder],
    )
    module = build(model)
    trainer.fit(module, loader)
    plan = getattr(trainer.strategy, "plan", None)
    return {
        "losses": recorder.losses, "logged": [step["train_loss"] for step in logger.steps if "train_loss" in step],
        "state": {key: value.detach().clone() for key, value in module.state_dict().items()},
        "microbatches": plan.pipeline.schedule.microbatches if plan is not None and plan.pipeline is not None else None,
    }


def pipeline_worker(rank: int, world_size: int, runs: list[tuple[str, str, str]]) -> dict[str, Any]:
    """Run every ``(label, strategy, model)`` in turn in one process group, as torchrun would start them
    (``LOCAL_RANK`` tells Lightning the processes exist already)."""
    torch.set_num_threads(1)  # two ranks share the cores: more intra-op threads only contend
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    return {label: fit(strategy, model, world_size) for label, strategy, model in runs}


def microbatched_single_device(model: str, microbatches: int) -> dict[str, Any]:
    """Eager training on one device, no Trainer, in the pipeline's data order: each step's ``GLOBAL_BATCH`` rows
    (``DistributedSampler``'s permutation with one replica, seed 0) run forward as ``microbatches`` consecutive
    row ranges, so BatchNorm normalizes each range with its own statistics, and one cross-entropy over all
    rows' logits gives the step's loss.

    The running statistics follow the plan's rule (measured, not torch.distributed.pipelining's, which
    updates them once per microbatch in turn): every microbatch's update starts from the step's values and
    the last microbatch's is kept, so they move once per step, from the last microbatch's rows.

    Returns:
        The per-step losses and the final weights and buffers.
    """
    module = build(model)
    optimizer = module.configure_optimizers()
    dataset = MODELS[model][1](GLOBAL_BATCH * STEPS)
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0)).tolist()
    losses = []
    for step in range(STEPS):
        images, labels = (torch.stack(column) for column in zip(*(dataset[index] for index in order[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH])))
        optimizer.zero_grad()
        before = {name: buffer.clone() for name, buffer in module.named_buffers()}
        logits = []
        for rows in images.chunk(microbatches):
            for name, value in before.items():  # new tensors: backward still reads those the last microbatch updated
                owner, _, attribute = name.rpartition(".")
                setattr(module.get_submodule(owner), attribute, value.clone())
            logits.append(module(rows))  # (GLOBAL_BATCH / microbatches, CLASSES)
        loss = F.cross_entropy(torch.cat(logits), labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "state": {key: value.detach().clone() for key, value in module.state_dict().items()}}
