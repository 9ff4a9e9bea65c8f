"""precision 16-mixed with a loss scaler: NnScalerStrategy seeds backward with the scale and shares
the overflow check, so every rank skips the same steps and the scale moves as on one device.

On CPU Lightning turns ``precision="16-mixed"`` into bf16, so the test passes the plugin itself
(``MixedPrecision("16-mixed", "cpu", GradScaler("cpu"))``); on CUDA ``precision="16-mixed"`` builds
the same plugin. The initial scale is large enough that the first steps overflow in fp16.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import lightning_nnscaler as lnn  # noqa: F401 - registers the strategies
from support.ranks import launch_ranks

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

from lightning_runs import GLOBAL_BATCH, TokenDataset, build_model, replica_batch_size  # noqa: E402

STEPS = 8
INITIAL_SCALE = 2.0**20


class ScaleRecorder(Callback):
    """Per step: the loss averaged over ranks and the loss scale after the step."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.scales: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))
        self.scales.append(trainer.precision_plugin.scaler.get_scale())


def fp16_worker(rank: int, world_size: int, strategies: list[str]) -> dict[str, dict[str, Any]]:
    """Fit each strategy in turn with a 16-mixed plugin and a GradScaler, in one process group."""
    torch.set_num_threads(1)
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    results = {}
    for strategy in strategies:
        recorder = ScaleRecorder()
        scaler = torch.amp.GradScaler("cpu", init_scale=INITIAL_SCALE, growth_interval=3)
        trainer = L.Trainer(
            strategy=strategy, accelerator="cpu", devices=world_size, max_steps=STEPS, plugins=[MixedPrecision("16-mixed", "cpu", scaler)],
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder],
        )
        batch_size = replica_batch_size(strategy, world_size)
        train = torch.utils.data.DataLoader(TokenDataset(GLOBAL_BATCH * STEPS, seed=1), batch_size=batch_size, shuffle=True, drop_last=True)
        trainer.fit(build_model(), train)
        results[strategy] = {"losses": recorder.losses, "scales": recorder.scales}
    return results


def single_device_fit() -> dict[str, Any]:
    """The same training with ``strategy="auto"`` on one device, in this process (the same sample order)."""
    recorder = ScaleRecorder()
    scaler = torch.amp.GradScaler("cpu", init_scale=INITIAL_SCALE, growth_interval=3)
    trainer = L.Trainer(
        strategy="auto", accelerator="cpu", devices=1, max_steps=STEPS, plugins=[MixedPrecision("16-mixed", "cpu", scaler)],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder],
    )
    dataset = TokenDataset(GLOBAL_BATCH * STEPS, seed=1)
    sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True)  # the strategies' order
    trainer.fit(build_model(), torch.utils.data.DataLoader(dataset, batch_size=GLOBAL_BATCH, sampler=sampler, drop_last=True))
    return {"losses": recorder.losses, "scales": recorder.scales}


@pytest.mark.timeout(300)
def test_16_mixed_skips_steps_and_scales_like_one_device() -> None:
    expected = single_device_fit()
    scales = expected["scales"]
    assert scales[0] < INITIAL_SCALE and any(later > earlier for earlier, later in zip(scales, scales[1:])), "steps skipped and grown"
    results = launch_ranks(fp16_worker, 2, ["nnscaler_tp", "nnscaler"], timeout=280)
    for strategy in ("nnscaler_tp", "nnscaler"):
        # The overflow check is shared: every rank skips the same steps and keeps the same scale.
        assert results[0][strategy]["scales"] == results[1][strategy]["scales"], f"{strategy}: ranks disagree on the loss scale"
        # fp16 autocast keeps ~3 significant digits per op, compounded over the steps.
        torch.testing.assert_close(torch.tensor(results[0][strategy]["losses"]), torch.tensor(expected["losses"]), rtol=5e-3, atol=0.0)
    # tp computes each sample's activations whole, like one device: the same steps overflow.
    assert results[0]["nnscaler_tp"]["scales"] == scales
