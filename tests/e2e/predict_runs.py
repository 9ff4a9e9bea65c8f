"""``trainer.predict`` under NnScalerStrategy, in one process group per rank (``runtime.launch``).

``predict_worker`` fits the GPT reference for one short epoch, predicts the test set, saves a checkpoint and
predicts it again from a new Trainer; a module built on meta (``trainer.init_module()``) does the same. Each rank
reports its predictions, the token batches it predicted (to compare with the eager module on the same rows), how
``predict_step`` ran (through the plan, or on the full module) and the trained weights.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch

import lightning_nnscaler as lnn  # noqa: F401 - registers the strategies

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

from feature_runs import EvaluatedGPT, loaders  # noqa: E402
from lightning_runs import replica_batch_size  # noqa: E402
from lightning_nnscaler.models.gpt import GPTConfig  # noqa: E402


class LabelledGPT(EvaluatedGPT):
    """A prediction with a label beside the logits: a plan returns tensors only, so the full module runs the step."""

    def predict_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {"logits": self(batch[0]), "label": "gpt"}


MODELS = {"logits": EvaluatedGPT, "labelled": LabelledGPT}


class PredictedBatches(Callback):
    """The tokens of every batch this rank predicted, in order."""

    def __init__(self) -> None:
        self.tokens: list[torch.Tensor] = []

    def on_predict_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.tokens.append(batch[0].clone())


def predict_worker(rank: int, world_size: int, runs: list[tuple[str, str, str, str]], root: str) -> dict[str, Any]:
    """Each run's ``predict_run`` on this rank (``LOCAL_RANK``: the processes exist, as under torchrun)."""
    torch.set_num_threads(1)  # two ranks share the cores
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    return {name: predict_run(strategy, world_size, kind, init, Path(root) / name) for name, strategy, kind, init in runs}


def build(kind: str, trainer: L.Trainer, init: str, seed: int) -> EvaluatedGPT:
    """The model, eagerly or on meta (``init="meta"``: under ``trainer.init_module()``), from ``seed``."""
    torch.manual_seed(seed)
    if init != "meta":
        return MODELS[kind](GPTConfig.small())
    with trainer.init_module():
        return MODELS[kind](GPTConfig.small())


def predict_run(strategy: str, devices: int, kind: str, init: str, save_dir: Path) -> dict[str, Any]:
    """Fit, predict, save, and predict the checkpoint from a new Trainer (or the error predicting stopped with)."""
    data = loaders(replica_batch_size(strategy, devices))
    options = dict(accelerator="cpu", devices=devices, logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer = L.Trainer(strategy=strategy, max_epochs=1, enable_checkpointing=False, num_sanity_val_steps=0, limit_val_batches=0, **options)
    model = build(kind, trainer, init, seed=0)
    trainer.fit(model, data["train"])
    batches = PredictedBatches()
    trainer.callbacks.append(batches)
    result: dict[str, Any] = {}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result["predictions"] = trainer.predict(model, data["test"])
        result["warnings"] = [str(warning.message) for warning in caught if "predict_step" in str(warning.message)]
    except Exception as error:  # noqa: BLE001 - the test reads the refusal
        return {"error": f"{type(error).__name__}: {error}"}
    result["tokens"] = batches.tokens
    plans = getattr(trainer.strategy, "_evaluation_plans", {})
    result["predicted_by"] = {key[0]: "module" if held is None else "plan" for key, held in plans.items()}
    full_state_dict = getattr(trainer.strategy, "full_state_dict", model.state_dict)  # ddp: the module's own
    result["state"] = {key: value.detach().clone() for key, value in full_state_dict().items()}
    checkpoint = save_dir / "last.ckpt"
    trainer.save_checkpoint(checkpoint)
    fresh = L.Trainer(strategy=strategy, callbacks=[PredictedBatches()], **options)
    restored = build(kind, fresh, init, seed=1)  # other initial weights: the checkpoint must replace them
    result["checkpoint_predictions"] = fresh.predict(restored, data["test"], ckpt_path=str(checkpoint))
    result["checkpoint_tokens"] = fresh.callbacks[-1].tokens if isinstance(fresh.callbacks[-1], PredictedBatches) else None
    result["on_meta"] = any(parameter.is_meta for parameter in restored.parameters())
    return result
