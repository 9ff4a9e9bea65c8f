"""V-shaped pipelines (ZB-V, V-Half, DualPipeV) under the Trainer at 2 and 4 gloo ranks (a GPT of 8 blocks), against ddp.

Rank r of p holds model stages r and 2p - 1 - r (at 4 ranks one block per stage, embeddings with the first,
the head with the last); per-batch losses, the logged and validation losses and the final weights equal
ddp's at rtol 1e-5. ZB-V and V-Half train 10 steps of the shared global batch of 4 at 2 and 4 ranks (ZB-V at 2 ranks also with
its stages cut by measured op times, `balance="measured"`, and its memory limit counted in saved bytes,
`activation_limit="bytes"`), DualPipeV
at 2 ranks (4 microbatches), also as the zb1 recipe's ``schedule_csv`` (its table in torch's CSV format). DualPipeV
needs 2p microbatches, 8 at 4 ranks: there it trains 3 steps of a global batch of 8 (``wide_batch_worker``),
where its moved forwards (``schedules.dual_pipe``) reorder the messages.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from support.ranks import launch_ranks

import lightning_runs  # noqa: E402
from lightning_runs import parity_worker  # noqa: E402

from lightning_nnscaler.schedules import dual_pipe_v, format_csv

OPTIONS = {"steps": 10, "model": "gpt8"}
V_SHAPES = {2: ["zbv", "vhalf", "dualpipev", "dualpipev csv", "zbv measured", "zbv bytes"], 4: ["zbv", "vhalf"]}
"""Rank count -> the runs on the shared global batch of 4 (DualPipeV at 4 ranks: `test_dualpipev_at_4_ranks_trains_like_ddp`)."""
WIDE_BATCH, WIDE_STEPS = 8, 3


def blocks(ranks: int) -> str:
    """``layers_per_stage`` for the 8 blocks over 2 × ``ranks`` stages."""
    return ",".join([str(8 // (2 * ranks))] * 2 * ranks)


def strategy(name: str, ranks: int, folder: Path) -> dict[str, Any]:
    """NnScalerStrategy's arguments for run ``name`` of `V_SHAPES`; "dualpipev csv" writes its table into ``folder``;
    "zbv measured" cuts its stages by the op times rank 0 measures (every rank must plan alike); "zbv bytes" counts its
    memory limit in each stage's saved bytes."""
    if name == "zbv measured":
        return {"recipe": "zbv", "balance": "measured"}
    if name == "zbv bytes":  # at 2 ranks its order differs from the one counted in stages
        return {"recipe": "zbv", "layers_per_stage": blocks(ranks), "activation_limit": "bytes"}
    if name == "dualpipev csv":
        table = folder / "dualpipev.csv"
        table.write_text(format_csv(dual_pipe_v(ranks, 4)))  # I, W and B cells, as torch writes them
        return {"recipe": "zb1", "schedule_csv": str(table), "layers_per_stage": blocks(ranks)}
    return {"recipe": name, "layers_per_stage": blocks(ranks)}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], dict[str, Any]]:
    """Rank count -> the results of ddp and that count's `V_SHAPES`, trained in one launch the first time asked."""
    cache: dict[int, dict[str, Any]] = {}

    def results(ranks: int) -> dict[str, Any]:
        if ranks not in cache:
            folder = tmp_path_factory.mktemp(f"v_shape_{ranks}")
            runs = [(name, strategy(name, ranks, folder), OPTIONS) for name in V_SHAPES[ranks]]
            with pytest.MonkeyPatch.context() as patch:  # the measured op times are kept here, not in the user's cache
                patch.setenv("LNN_PROFILE_CACHE", str(folder / "profiles"))
                cache[ranks] = launch_ranks(parity_worker, ranks, [("ddp", "ddp", OPTIONS), *runs], timeout=400)[0]
        return cache[ranks]

    return results


def assert_trains_like(ours: dict[str, Any], ddp: dict[str, Any], name: str) -> None:
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(ddp["losses"]), rtol=1e-5, atol=1e-6)
    assert ours["train_loss"] == pytest.approx(ddp["train_loss"], rel=1e-5)
    assert ours["val_loss"] == pytest.approx(ddp["val_loss"], rel=1e-5)
    for key, value in ddp["state"].items():
        torch.testing.assert_close(ours["state"][key], value, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{name} {k}: {m}")


@pytest.mark.timeout(500)
@pytest.mark.parametrize(("ranks", "name"), [(ranks, name) for ranks, names in V_SHAPES.items() for name in names],
                         ids=lambda value: f"{value} ranks" if isinstance(value, int) else value)
def test_v_shaped_pipelines_train_like_ddp(trained: Callable[[int], dict[str, Any]], ranks: int, name: str) -> None:
    results = trained(ranks)
    assert_trains_like(results[name], results["ddp"], name)


def wide_batch_worker(rank: int, world_size: int, runs: list[tuple[str, Any, dict[str, Any]]]) -> dict[str, Any]:
    """`parity_worker` with a global batch of `WIDE_BATCH` (this rank process's copy of ``lightning_runs`` is rebound)."""
    lightning_runs.GLOBAL_BATCH = WIDE_BATCH
    replica_rows = lightning_runs.replica_batch_size
    lightning_runs.replica_batch_size = lambda strategy, devices: replica_rows(strategy, devices, WIDE_BATCH)
    return parity_worker(rank, world_size, runs)


@pytest.mark.timeout(300)
def test_dualpipev_at_4_ranks_trains_like_ddp() -> None:
    options = {"steps": WIDE_STEPS, "model": "gpt8"}
    strategy = {"recipe": "dualpipev", "layers_per_stage": blocks(4)}  # microbatches null: 8, one per stage
    results = launch_ranks(wide_batch_worker, 4, [("ddp", "ddp", options), ("dualpipev", strategy, options)], timeout=250)[0]
    assert len(results["dualpipev"]["losses"]) == WIDE_STEPS
    assert_trains_like(results["dualpipev"], results["ddp"], "dualpipev")
