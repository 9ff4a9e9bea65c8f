"""A real fit with a real offline ``WandbLogger``: the run's summary holds the predicted step (the
simulator's, on the measured ``cpu`` spec), the measured one (the median optimizer step after the first
few) and their ratio, as W&B wrote them to the run's files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_nnscaler import NnScalerStrategy
from lightning_nnscaler.models.gpt import GPTConfig
from lightning_nnscaler.sim import predict
from lightning_nnscaler.strategy.plan_logging import MEASURED_OVER_PREDICTED_KEY, MEASURED_STEP_KEY, PREDICTED_SPEC_KEY, PREDICTED_STEP_KEY
from lightning_nnscaler.strategy.step_timing import MEASURED_AFTER

import lightning as L  # noqa: E402 - after lightning_nnscaler
from lightning.pytorch.loggers import WandbLogger  # noqa: E402

from lightning_runs import GLOBAL_BATCH, ScheduledGPT, TokenDataset  # noqa: E402
from wandb_runs import read_wandb_run, wait_for_finished_run  # noqa: E402

STEPS = MEASURED_AFTER + 3


@pytest.mark.timeout(120)
def test_wandb_summary_holds_the_predicted_and_measured_step_and_their_ratio(
    one_rank_group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import wandb

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))  # no network, nothing outside the test's folder
    torch.manual_seed(0)
    model = ScheduledGPT(GPTConfig.small())
    train = torch.utils.data.DataLoader(TokenDataset(GLOBAL_BATCH * STEPS, seed=1), batch_size=GLOBAL_BATCH, drop_last=True)
    trainer = L.Trainer(
        strategy=NnScalerStrategy(), accelerator="cpu", devices=1, max_steps=STEPS, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
        logger=WandbLogger(save_dir=str(tmp_path), offline=True, project="lightning-nnscaler-tests"),
    )
    trainer.fit(model, train)
    wandb.finish()
    wait_for_finished_run(tmp_path)

    config, summary, history, _ = read_wandb_run(tmp_path)
    predicted, measured = summary[PREDICTED_STEP_KEY], summary[MEASURED_STEP_KEY]
    assert predicted > 0 and measured > 0
    assert summary[MEASURED_OVER_PREDICTED_KEY] == pytest.approx(measured / predicted)
    assert predicted == pytest.approx(predict(trainer.strategy.plan, "cpu").step_seconds * 1e3)
    assert summary[PREDICTED_SPEC_KEY] == config[PREDICTED_SPEC_KEY] and summary[PREDICTED_SPEC_KEY].startswith("cpu")
    assert config[PREDICTED_STEP_KEY] == predicted
    timer = trainer.strategy.step_timer
    assert len(timer.seconds) == STEPS - MEASURED_AFTER and measured == pytest.approx(timer.median_seconds() * 1e3)
    assert [step for step, _ in history[MEASURED_STEP_KEY]] == [STEPS]  # once, at the end of the fit
