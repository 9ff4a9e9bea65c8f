"""Evaluation loops under NnScalerStrategy and DDP, in one process group per rank (``runtime.launch``).

``evaluation_worker`` fits the GPT reference for two short epochs with a sanity check and a validation
loop per epoch, then runs ``validate`` and ``test``, saves a checkpoint and validates it from a new
Trainer. It reports every validation loss, the loops' results and how each evaluation step ran (through
a forward-only plan over the training pieces, or on the full module).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

import lightning_nnscaler as lnn  # noqa: F401 - registers the strategies

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

from feature_runs import EvaluatedGPT, loaders  # noqa: E402
from lightning_runs import replica_batch_size  # noqa: E402
from lightning_nnscaler.models.gpt import GPTConfig  # noqa: E402


class LoggingOnlyGPT(EvaluatedGPT):
    """Validation that logs its loss and returns nothing (the graph's output is the logged number)."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.compute_loss(batch), sync_dist=True)


class DictValidatedGPT(EvaluatedGPT):
    """Validation that returns a dict beside the loss: the plan cannot return it, the full module runs the step."""

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        logits = self(batch[0])
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), batch[1].view(-1))
        self.log("val_loss", loss, sync_dist=True)
        return {"loss": loss, "logits": logits}


MODELS = {"value": EvaluatedGPT, "none": LoggingOnlyGPT, "dict": DictValidatedGPT}


class ValidationLosses(Callback):
    """Every validation loop's ``val_loss`` (the sanity check's too)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.losses.append(float(trainer.callback_metrics["val_loss"]))


def evaluation_worker(rank: int, world_size: int, runs: list[tuple[str, Any, str]], root: str) -> dict[str, Any]:
    """Each run's ``evaluation_run`` on this rank (``LOCAL_RANK``: the processes exist, as under torchrun)."""
    torch.set_num_threads(1)  # two ranks share the cores
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    return {name: evaluation_run(strategy, world_size, kind, Path(root) / name) for name, strategy, kind in runs}


def evaluation_run(strategy: Any, devices: int, kind: str, save_dir: Path) -> dict[str, Any]:
    """Fit (sanity check, a validation per epoch), validate, test, save, and validate the checkpoint anew."""
    data = loaders(replica_batch_size(strategy, devices))
    losses = ValidationLosses()
    options = dict(accelerator="cpu", devices=devices, logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer = L.Trainer(strategy=strategy, max_epochs=2, callbacks=[losses], enable_checkpointing=False, num_sanity_val_steps=1, **options)
    torch.manual_seed(0)
    model = MODELS[kind](GPTConfig.small())
    trainer.fit(model, data["train"], data["val"])
    result: dict[str, Any] = {"fit_losses": losses.losses}
    result["validate"] = trainer.validate(model, data["val"], verbose=False)[0]["val_loss"]
    result["test"] = trainer.test(model, data["test"], verbose=False)[0]["test_loss"]
    plans = getattr(trainer.strategy, "_evaluation_plans", {})
    result["evaluated_by"] = {key[0]: "module" if held is None else "plan" for key, held in plans.items()}
    checkpoint = save_dir / "last.ckpt"
    trainer.save_checkpoint(checkpoint)
    torch.manual_seed(1)  # other initial weights: the checkpoint must replace them
    restored = MODELS[kind](GPTConfig.small())
    fresh = L.Trainer(strategy=strategy, **options)
    result["validate_checkpoint"] = fresh.validate(restored, data["val"], ckpt_path=str(checkpoint), verbose=False)[0]["val_loss"]
    result["state"] = {key: value.detach().clone() for key, value in model.state_dict().items()}
    return result
