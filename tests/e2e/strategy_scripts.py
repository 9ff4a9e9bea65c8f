"""Scripts the e2e tests run as separate processes (as a user's training script runs).

``python strategy_scripts.py two_node OUTPUT_DIR``: one "node" of ``Trainer(strategy="nnscaler",
devices=1, num_nodes=2)``; the node comes from ``NODE_RANK`` and the rendezvous from ``MASTER_ADDR``,
``MASTER_PORT`` and ``WORLD_SIZE``, as Lightning's ``LightningEnvironment`` reads them. Each node writes
its per-step losses, global rank and world size to OUTPUT_DIR/node{NODE_RANK}.json.

``python strategy_scripts.py rank_raises TIMEOUT_S``: as ``rank_dies``, but rank 1 raises
``ValueError("boom from rank 1")`` at step ``DEATH_STEP`` (a bug on one rank), on a small model.

``python strategy_scripts.py rank_killed_at_the_end TIMEOUT_S``: a 2-device fit whose rank 1 is SIGKILLed in
``teardown``, after the last collective; the run must exit non-zero all the same.

``python strategy_scripts.py rank_dies TIMEOUT_S DEATH_FILE``: ``strategy="nnscaler"`` on 2 devices
(Lightning's script launcher starts rank 1), and rank 1 writes the time to DEATH_FILE and kills itself
with SIGKILL at step ``DEATH_STEP``; the run must fail rather than hang (collectives time out after
TIMEOUT_S).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import lightning_nnscaler as lnn  # noqa: F401 - registers the strategies

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # lightning_runs beside this file, when run as a script
from lightning_runs import GLOBAL_BATCH, OneThreadPerRank, TokenDataset, build_model, fit_gpt  # noqa: E402

DEATH_STEP = 3


class DieAtStep(Callback):
    """At ``step`` on ``rank``: write ``time.time()`` to ``death_file``, then kill this process with SIGKILL
    (no cleanup, as a crashed or OOM-killed node)."""

    def __init__(self, rank: int, step: int, death_file: str) -> None:
        self.rank = rank
        self.step = step
        self.death_file = death_file

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            Path(self.death_file).write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)


class TinyRegressor(L.LightningModule):
    """Two linear layers: plans and steps in well under a second."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return torch.nn.functional.mse_loss(self.net(inputs), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class RaiseAtStep(Callback):
    """At ``step`` on ``rank``: raise ``ValueError(f"boom from rank {rank}")`` (a bug in one rank's code)."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank = rank
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            raise ValueError(f"boom from rank {self.rank}")


def two_node(output_dir: str) -> None:
    """This node's share of a 2-node run with one device per node; writes what it trained and as which rank."""
    torch.set_num_threads(1)
    result = fit_gpt("nnscaler", devices=1, num_nodes=2, validate=False)
    ranks = {"global_rank": dist.get_rank(), "world_size": dist.get_world_size()}  # the group the Trainer joined
    report = {"losses": result["losses"], "train_loss": result["train_loss"], **ranks}
    Path(output_dir, f"node{os.environ['NODE_RANK']}.json").write_text(json.dumps(report))


def rank_dies(timeout: float, death_file: str) -> None:
    """Train on 2 devices until rank 1 dies at step ``DEATH_STEP``; what follows is the strategy's to handle."""
    torch.set_num_threads(1)
    train = torch.utils.data.DataLoader(TokenDataset(GLOBAL_BATCH * 50, seed=1), batch_size=GLOBAL_BATCH, drop_last=True)
    trainer = L.Trainer(
        strategy=lnn.NnScalerStrategy(timeout=timeout), accelerator="cpu", devices=2, max_steps=50, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[OneThreadPerRank(), DieAtStep(rank=1, step=DEATH_STEP, death_file=death_file)],
    )
    trainer.fit(build_model(), train)


class DieAtTeardown(Callback):
    """At the very end of the fit, after its last collective, ``rank`` kills itself with SIGKILL (as the OOM killer would)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.global_rank == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)


def rank_killed_at_the_end(timeout: float) -> None:
    """A 2-device fit of a small model whose rank 1 is SIGKILLed at teardown, after the last step."""
    fit_tiny_regressor(timeout, steps=3, callback=DieAtTeardown(rank=1))
    print("fit returned")


def rank_raises(timeout: float) -> None:
    """Train a small model on 2 devices until rank 1 raises ``ValueError("boom from rank 1")`` at step ``DEATH_STEP``."""
    fit_tiny_regressor(timeout, steps=20, callback=RaiseAtStep(rank=1, step=DEATH_STEP))


def fit_tiny_regressor(timeout: float, *, steps: int, callback: Callback) -> None:
    """`TinyRegressor` on 2 devices for ``steps`` steps of 4 samples, with ``callback``."""
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    samples = torch.utils.data.TensorDataset(torch.randn(4 * steps, 8, generator=generator), torch.randn(4 * steps, 1, generator=generator))
    trainer = L.Trainer(
        strategy=lnn.NnScalerStrategy(timeout=timeout), accelerator="cpu", devices=2, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
    )
    trainer.fit(TinyRegressor(), torch.utils.data.DataLoader(samples, batch_size=4))


if __name__ == "__main__":
    command, arguments = sys.argv[1], sys.argv[2:]
    if command == "two_node":
        two_node(*arguments)
    elif command == "rank_dies":
        rank_dies(float(arguments[0]), arguments[1])
    elif command == "rank_raises":
        rank_raises(float(arguments[0]))
    elif command == "rank_killed_at_the_end":
        rank_killed_at_the_end(float(arguments[0]))
    else:
        raise SystemExit(
            f"unknown command {command!r}: use two_node OUTPUT_DIR, rank_dies TIMEOUT_S DEATH_FILE, rank_raises TIMEOUT_S or rank_killed_at_the_end TIMEOUT_S"
        )
