"""Trainer features under NnScalerStrategy and DDP, run in one process group per rank (``runtime.launch``).

``features_worker`` trains the GPT reference for a few short epochs with what a real run has: CSV,
TensorBoard (and optionally W&B) loggers, ``LearningRateMonitor``, ``EarlyStopping`` and
``ModelCheckpoint`` on ``val_loss``; then runs ``validate``, ``test`` and ``predict``. The tests compare
what the loggers wrote and the loops returned between strategies and with single-device execution.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch

import lightning_nnscaler as lnn  # noqa: F401 - registers the strategies

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger, WandbLogger  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_runs import GLOBAL_BATCH, ScheduledGPT, TokenDataset, replica_batch_size  # noqa: E402
from lightning_nnscaler.models.gpt import GPTConfig  # noqa: E402

STEPS_PER_EPOCH = 2
MAX_EPOCHS = 8
TEST_SAMPLES = 2 * GLOBAL_BATCH
EARLY_STOPPING = {"monitor": "val_loss", "patience": 1, "min_delta": 0.076}
"""val_loss falls by 0.105, 0.081, 0.072, 0.063, ... per epoch here: training stops at epoch 3 of 8, with
margins of 4e-3 either side of ``min_delta`` (any strategy that computes other numbers stops elsewhere)."""


class EvaluatedGPT(ScheduledGPT):
    """The GPT reference with test and predict steps (predict returns the logits)."""

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """The batch's loss, logged as test_loss."""
        loss = self.compute_loss(batch)
        self.log("test_loss", loss, sync_dist=True)
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Logits (B, T, vocab) of the batch's tokens."""
        return self(batch[0])


def build_evaluated_model() -> EvaluatedGPT:
    """The same initial weights in every process."""
    torch.manual_seed(0)
    return EvaluatedGPT(GPTConfig.small())


def loaders(batch_size: int) -> dict[str, DataLoader]:
    """Train (shuffled, ``STEPS_PER_EPOCH`` global batches), validation (the training samples: how well
    the run fits them, a loss that falls by less each epoch) and test (new samples) loaders."""
    return {
        "train": DataLoader(TokenDataset(GLOBAL_BATCH * STEPS_PER_EPOCH, seed=1), batch_size=batch_size, shuffle=True, drop_last=True),
        "val": DataLoader(TokenDataset(GLOBAL_BATCH * STEPS_PER_EPOCH, seed=1), batch_size=batch_size),
        "test": DataLoader(TokenDataset(TEST_SAMPLES, seed=3), batch_size=batch_size),
    }


def make_loggers(save_dir: Path, wandb: bool) -> list[Logger]:
    """CSV and TensorBoard loggers under ``save_dir``, and an offline W&B one if asked."""
    loggers: list[Logger] = [CSVLogger(save_dir, name="csv"), TensorBoardLogger(save_dir, name="tb", default_hp_metric=False)]
    if wandb:
        loggers.append(WandbLogger(save_dir=str(save_dir), offline=True, project="lightning-nnscaler-tests"))
    return loggers


def features_worker(rank: int, world_size: int, runs: list[tuple[str, Any, dict[str, Any]]], root: str) -> dict[str, Any]:
    """Run ``features_run`` for every ``(label, strategy, options)`` in one process group, under ``root/label``."""
    torch.set_num_threads(1)  # two ranks share the cores: more intra-op threads only contend
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    return {label: features_run(strategy, world_size, Path(root) / label, **options) for label, strategy, options in runs}


def features_run(strategy: Any, devices: int, save_dir: Path, *, wandb: bool = False, evaluate: bool = True) -> dict[str, Any]:
    """Fit with loggers, LR monitor, early stopping and best-checkpoint tracking; then validate, test, predict.

    Returns:
        The epoch early stopping stopped at, the best checkpoint's path and score, the validate/test
        metrics, this rank's predictions (logits, in loader order), the final full weights and the
        plan hash (nnscaler only).
    """
    data = loaders(replica_batch_size(strategy, devices))
    early_stopping = EarlyStopping(**EARLY_STOPPING)
    best = ModelCheckpoint(dirpath=save_dir / "checkpoints", monitor="val_loss", save_top_k=1, filename="{epoch}-{val_loss:.4f}")
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_epochs=MAX_EPOCHS, logger=make_loggers(save_dir, wandb),
        callbacks=[LearningRateMonitor(logging_interval="step"), early_stopping, best], log_every_n_steps=1,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    model = build_evaluated_model()
    trainer.fit(model, data["train"], data["val"])
    result: dict[str, Any] = {
        "stopped_epoch": early_stopping.stopped_epoch, "epochs_run": trainer.current_epoch,
        "best_model_path": Path(best.best_model_path).name, "best_model_score": float(best.best_model_score),
        "plan_hash": getattr(getattr(trainer.strategy, "plan", None), "plan_hash", None),
    }
    if evaluate:
        result["validate"] = trainer.validate(model, data["val"], verbose=False)[0]
        result["test"] = trainer.test(model, data["test"], verbose=False)[0]
        result["predictions"] = torch.cat(trainer.predict(model, data["test"]))
        plans = getattr(trainer.strategy, "_evaluation_plans", {})  # how each evaluation step ran: "plan" or "module"
        result["evaluated_by"] = {key[0]: "module" if held is None else "plan" for key, held in plans.items()}
    result["state"] = {key: value.detach().clone() for key, value in model.state_dict().items()}
    if wandb and trainer.global_rank == 0:
        import wandb as wandb_module

        wandb_module.finish()  # flush the offline run's files
    return result


def setup_error_worker(rank: int, world_size: int, cases: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[dict[str, Any]]:
    """Fit the GPT reference with ``NnScalerStrategy(**strategy_arguments)`` and ``GPTConfig.small()``
    changed by ``config_changes``, per case; returns the ``MisconfigurationException`` message (None if
    fit ran), the optimizer steps taken and whether a batch was planned."""
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    torch.set_num_threads(1)
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    outcomes = []
    for strategy_arguments, config_changes in cases:
        torch.manual_seed(0)
        model = ScheduledGPT(GPTConfig(**{**vars(GPTConfig.small()), **config_changes}))
        trainer = L.Trainer(
            strategy=lnn.NnScalerStrategy(**strategy_arguments), accelerator="cpu", devices=world_size, max_steps=2,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )
        message = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", lnn.PartialPlanWarning)
            try:
                trainer.fit(model, DataLoader(TokenDataset(2 * GLOBAL_BATCH, seed=1), batch_size=GLOBAL_BATCH, drop_last=True))
            except MisconfigurationException as error:
                message = str(error)
        partial = [str(warning.message) for warning in caught if issubclass(warning.category, lnn.PartialPlanWarning)]
        outcomes.append({"message": message, "global_step": trainer.global_step, "planned": trainer.strategy.plan is not None, "partial": partial})
    return outcomes
