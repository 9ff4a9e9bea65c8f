"""Resuming a module built on meta under another plan and world size, each rank reading only its slices.

Saved by tp on 2 ranks and by 1f1b on 4 (1 epoch of 10 steps each, the model built under
``trainer.init_module()``); resumed for a second epoch by zero3 on 4 ranks and by tp on 2. No rank assembles
the checkpoint: each reads the slices of its own pieces (``checkpoint.read_pieces``), and the bytes it reads
are about its share of the checkpoint. The second epoch's losses and the final weights equal an uninterrupted
2-epoch tp run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from support.ranks import launch_ranks

from checkpoint_runs import STEPS_PER_EPOCH, runs_worker  # noqa: E402

SAVED = "epoch=0-step=10.ckpt"
META = {"init": "init_module", "validate": False}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    saved = tmp_path_factory.mktemp("meta_checkpoints")
    two = [
        ("uninterrupted tp", "nnscaler_tp", 2, META),
        ("tp saving", "nnscaler_tp", 1, {**META, "checkpoint_dir": str(saved / "tp")}),
    ]
    results = launch_ranks(runs_worker, 2, two, timeout=300)[0]
    four = [
        ("zero3 resumed from tp", "nnscaler_zero3", 2, {**META, "resume_from": str(saved / "tp" / SAVED)}),
        ("1f1b saving", "nnscaler_1f1b", 1, {**META, "checkpoint_dir": str(saved / "1f1b")}),
    ]
    results.update(launch_ranks(runs_worker, 4, four, timeout=300)[0])
    back = [("tp resumed from 1f1b", "nnscaler_tp", 2, {**META, "resume_from": str(saved / "1f1b" / SAVED)})]
    results.update(launch_ranks(runs_worker, 2, back, timeout=300)[0])
    return saved, results


def checkpoint_bytes(directory: Path) -> int:
    """Bytes of a sharded checkpoint's rank files (its pieces)."""
    return sum(path.stat().st_size for path in directory.rglob("rank*") if path.is_file())


@pytest.mark.timeout(900)
@pytest.mark.parametrize("label, source, share", [("zero3 resumed from tp", "tp", 0.35), ("tp resumed from 1f1b", "1f1b", 0.65)])
def test_resumed_under_another_plan_reading_only_its_slices(results: tuple[Path, dict[str, Any]], label: str, source: str, share: float) -> None:
    saved, runs = results
    expected = runs["uninterrupted tp"]
    actual = runs[label]
    torch.testing.assert_close(torch.tensor(actual["losses"]), torch.tensor(expected["losses"][STEPS_PER_EPOCH:]), rtol=1e-5, atol=1e-6)
    for key, value in expected["state"].items():
        torch.testing.assert_close(actual["state"][key], value, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{label} {k}: {m}")
    total = checkpoint_bytes(saved / source / SAVED)
    assert 0 < actual["bytes_read"] <= share * total, f"rank 0 read {actual['bytes_read']} of {total} bytes"
