"""``recipe="auto"`` under a Trainer at 2 gloo ranks says what it chose and measured: rank 0 prints the winner and the
ranked table of candidates (predicted step time, peak memory), and every logger's hyperparameters hold the chosen
recipe and its parameters (read back from the CSV logger's hparams.yaml). Its plain cross_entropy, whose replicas keep
every target, gives no ``GlobalMeanWarning``."""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from lightning_nnscaler import GlobalMeanWarning, NnScalerStrategy
from lightning_nnscaler.models.gpt import GPTConfig
from lightning_nnscaler.strategy.plan_logging import PLAN_KEY, SEARCH_ROWS
from support.ranks import launch_ranks

import lightning as L  # noqa: E402 - after lightning_nnscaler
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_runs import GLOBAL_BATCH, ScheduledGPT, TokenDataset  # noqa: E402

STEPS = 2
SEARCHED = "tp,coshard"  # a few candidates (a search of seconds), each with parameters to log


class ConsoleLines(logging.Handler):
    """The lines Lightning's console logger prints (``rank_zero_info`` among them)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def auto_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Fit the small GPT with ``recipe="auto"`` and a CSV logger under ``root``; returns what was searched and printed."""
    torch.set_num_threads(1)  # two ranks share the cores
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    console = ConsoleLines()
    logging.getLogger("lightning.pytorch").addHandler(console)
    torch.manual_seed(0)
    train = DataLoader(TokenDataset(GLOBAL_BATCH * STEPS, seed=1), batch_size=GLOBAL_BATCH // world_size, drop_last=True)
    trainer = L.Trainer(
        strategy=NnScalerStrategy(recipe="auto", recipes=SEARCHED), accelerator="cpu", devices=world_size, max_steps=STEPS,
        logger=CSVLogger(root, name="csv"), log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(ScheduledGPT(GPTConfig.small()), train)
    search = trainer.strategy.plan.search
    best = search.best
    return {
        "chosen": {"recipe": best.candidate.recipe, "params": best.candidate.kwargs, "ms": best.step_seconds * 1e3, "peak": best.peak_bytes},
        "candidates": [str(outcome.candidate) for outcome in search.outcomes],
        "table": search.table(SEARCH_ROWS),
        "console": console.lines,
        "global_mean_warnings": [str(warning.message) for warning in caught if issubclass(warning.category, GlobalMeanWarning)],
    }


@pytest.mark.timeout(300)
def test_auto_logs_its_pick_and_the_ranked_candidates(tmp_path: Path) -> None:
    rank0, rank1 = launch_ranks(auto_worker, 2, str(tmp_path), timeout=240)
    chosen = rank0["chosen"]
    assert rank1["chosen"] == chosen  # every rank searched alike

    hparams = yaml.safe_load((tmp_path / "csv" / "version_0" / "hparams.yaml").read_text())[PLAN_KEY]
    assert hparams["recipe"] == "auto" and hparams["recipe_params"]["recipes"] == SEARCHED
    search = hparams["search"]
    assert search["chosen_recipe"] == chosen["recipe"] and search["chosen_params"] == chosen["params"] != {}
    assert search["predicted_step_ms"] == pytest.approx(chosen["ms"]) and search["peak_bytes"] == chosen["peak"]
    assert search["spec"].startswith("cpu") and search["candidates_searched"] == len(rank0["candidates"]) > 1
    ranked = search["ranked"]
    assert [row["candidate"] for row in ranked] == rank0["candidates"][:SEARCH_ROWS]
    assert ranked[0]["candidate"] == " ".join([chosen["recipe"], *(f"{key}={value}" for key, value in chosen["params"].items())])
    assert ranked[0]["fits"] == "yes" and ranked[0]["predicted_step_ms"] == pytest.approx(chosen["ms"])

    printed = "\n".join(rank0["console"])
    assert f"recipe 'auto' chose {ranked[0]['candidate']}" in printed and rank0["table"] in printed
    assert not any("recipe 'auto' chose" in line for line in rank1["console"])  # rank 0 alone prints it
    assert rank0["global_mean_warnings"] == rank1["global_mean_warnings"] == []  # every target kept: ddp's mean is the global one
