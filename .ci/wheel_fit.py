"""Every recipe, and a 2-rank fit, from the installed wheel: ``.ci/wheel_check.sh`` copies this file to a
temporary directory outside the repository and runs it with the fresh virtual environment's python.

First (launching process only) every catalog recipe plans the reference GPT for 2 virtual ranks
and ``plan.verify()`` proves it equals one device; then a 2-rank ``nnscaler_tp`` fit runs.

Lightning's launcher re-runs this file once per extra rank, so the work stays under ``__main__``.
Prints ``wheel fit: OK ... loss ...`` on rank 0; any failure exits non-zero.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning_nnscaler as lnn  # registers the strategies

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

STEPS = 3


class TinyRegression(L.LightningModule):
    """Linear -> GELU -> Linear, mean squared error."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return torch.nn.functional.mse_loss(self(inputs), targets)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class LossRecorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"].detach()))


RECIPE_PARAMS = {"hybrid": {"dp": 1, "tp": 2}, "coshard": {"shards": 1}}  # fit 2 ranks and GPTConfig.small()'s 4 heads
RECYCLING_RECIPES = {"3f1b"}  # plan a model with recycling passes (the Evoformer reference, r = 3)


def verify_every_recipe() -> None:
    """Plan and verify the reference GPT (the Evoformer with recycling for 3f1b) with every catalog recipe
    at 2 virtual ranks (one process)."""
    from dataclasses import replace

    from lightning_nnscaler.models.evoformer import Evoformer, EvoformerConfig
    from lightning_nnscaler.models.gpt import GPT, GPTConfig

    gpt, recycling = GPT(GPTConfig.small()), Evoformer(replace(EvoformerConfig.small(), recycles=3))
    for spec in lnn.list_recipes():
        model = recycling if spec.name in RECYCLING_RECIPES else gpt
        batch = model.example_batch(4, torch.Generator().manual_seed(0))
        plan = lnn.parallelize(model, batch, spec.name, 2, step="training_step", **RECIPE_PARAMS.get(spec.name, {}))
        report = plan.verify()
        print(f"wheel fit: recipe {spec.name} verified at 2 ranks (loss {report.loss:.4f})", flush=True)


def main() -> None:
    installed = Path(lnn.__file__).resolve()
    prefix = Path(sys.prefix).resolve()
    if prefix not in installed.parents:
        sys.exit(f"wheel fit: lightning_nnscaler imported from {installed}, not from the virtual environment {prefix}")
    torch.set_num_threads(1)
    if "LOCAL_RANK" not in os.environ:  # the launching process, not the ranks Lightning starts
        verify_every_recipe()
    torch.manual_seed(0)
    inputs = torch.randn(64, 8)
    data = TensorDataset(inputs, inputs.sum(dim=1, keepdim=True))
    recorder = LossRecorder()
    trainer = L.Trainer(
        strategy="nnscaler_tp", accelerator="cpu", devices=2, max_steps=STEPS, callbacks=[recorder],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(TinyRegression(), DataLoader(data, batch_size=8))
    losses = recorder.losses
    if len(losses) != STEPS or not all(torch.isfinite(torch.tensor(losses))):
        sys.exit(f"wheel fit: rank {trainer.global_rank} expected {STEPS} finite losses, got {losses}")
    if trainer.global_rank == 0:
        print(f"wheel fit: OK, {trainer.world_size} ranks, lightning_nnscaler from {installed.parent}, loss {losses[-1]:.4f}", flush=True)


if __name__ == "__main__":
    main()
