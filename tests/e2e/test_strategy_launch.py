"""Lightning's own launchers start NnScalerStrategy's processes: the script launcher (``strategy="nnscaler"``,
the default ``start_method="popen"``, as a user's script runs) and the spawn launcher (from pytest)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lightning_nnscaler as lnn

import lightning as L  # noqa: E402 - after lightning_nnscaler

from lightning_runs import GLOBAL_BATCH, STEPS, OneThreadPerRank, TokenDataset, build_model, single_device_run  # noqa: E402


@pytest.fixture(scope="module")
def single_device() -> tuple[list[float], dict[str, torch.Tensor]]:
    return single_device_run()


@pytest.mark.timeout(300)
def test_script_launch_with_registered_name(tmp_path: Path, single_device: tuple[list[float], dict]) -> None:
    output = tmp_path / "losses.json"
    script = Path(__file__).with_name("lightning_runs.py")
    completed = subprocess.run(
        [sys.executable, str(script), "nnscaler", "2", str(output)], capture_output=True, text=True, timeout=280, cwd=tmp_path
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    result = json.loads(output.read_text())
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(single_device[0]), rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(300)
def test_spawn_launch_returns_trained_weights(single_device: tuple[list[float], dict]) -> None:
    expected_losses, expected_state = single_device
    model = build_model()
    train = torch.utils.data.DataLoader(TokenDataset(GLOBAL_BATCH * STEPS, seed=1), batch_size=GLOBAL_BATCH, shuffle=True, drop_last=True)
    trainer = L.Trainer(
        strategy=lnn.NnScalerStrategy(recipe="tp", start_method="spawn"), accelerator="cpu", devices=2, max_steps=STEPS,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[OneThreadPerRank()],
    )
    trainer.fit(model, train)
    assert float(trainer.callback_metrics["train_loss"]) == pytest.approx(expected_losses[-1], rel=1e-5)
    # The spawn launcher hands rank 0's LightningModule weights back: assembled from both ranks' shards.
    for key, value in expected_state.items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
