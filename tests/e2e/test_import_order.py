"""Import order never matters: a docs-style training script whose first line is ``import lightning``,
``import timm`` or ``import torchvision`` trains under ``nnscaler_tp`` on 2 ranks, each in a fresh
interpreter, with the losses of the same script under ``ddp`` on one device (whose DistributedSampler
shuffles as the tensor-parallel plan's single replica does).

The README's install puts PyPI's torchvision (a CUDA build whose kernels cannot load next to the CPU
torch pin) beside torch; torch's import runs the ``lightning_nnscaler_torchvision`` entry point, which
keeps it importable whatever comes first.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = '''\
import {first_import}
import json
import sys

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_nnscaler  # noqa: F401 - registers the nnscaler strategies


class LitRegressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        loss = F.mse_loss(self.net(inputs), targets)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class RecordLosses(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


if __name__ == "__main__":
    strategy, devices, output = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    torch.manual_seed(0)
    model = LitRegressor()
    data = TensorDataset(torch.randn(64, 16), torch.randn(64, 4))
    record = RecordLosses()
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=4, logger=False, callbacks=[record],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=16))
    if trainer.global_rank == 0:
        with open(output, "w") as file:
            json.dump(record.losses, file)
'''


def run_script(tmp_path: Path, first_import: str, strategy: str, devices: int) -> list[float]:
    folder = tmp_path / f"{first_import}-{strategy}"
    folder.mkdir()
    script = folder / "train.py"
    script.write_text(SCRIPT.format(first_import=first_import))
    output = folder / "losses.json"
    completed = subprocess.run(
        [sys.executable, str(script), strategy, str(devices), str(output)], cwd=folder, capture_output=True, text=True, timeout=280
    )
    assert completed.returncode == 0, f"`import {first_import}` first, {strategy}:\n{completed.stderr[-4000:]}"
    return json.loads(output.read_text())


@pytest.fixture(scope="module")
def one_device_losses(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    return run_script(tmp_path_factory.mktemp("one_device"), "lightning", "ddp", 1)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("first_import", ["lightning", "timm", "torchvision"])
def test_a_docs_style_script_trains_whatever_it_imports_first(first_import: str, tmp_path: Path, one_device_losses: list[float]) -> None:
    losses = run_script(tmp_path, first_import, "nnscaler_tp", 2)
    assert len(losses) == 4
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(one_device_losses), rtol=1e-5, atol=1e-6)
