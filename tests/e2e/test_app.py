"""The product surface as a user meets it: the Hydra training app run as the README says (a
subprocess, Lightning's launcher starting the second rank), a sweep's comparison table, and
``lightning-nnscaler plan``. Sizes and steps are cut with overrides to keep CI short."""

from __future__ import annotations

import ast
import csv
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_nnscaler import cli

REPO = Path(__file__).resolve().parents[2]
PYTHONPATH = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
"""The child processes import this checkout (whatever the installed copy is)."""
TINY = ["model.config.hidden=32", "model.config.layers=1", "data.max_files=30", "sample.tokens=0", "logger=none"]
"""Overrides that make a job small: one narrow block, 30 files of text, no sample, no logger."""


def run_app(arguments: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """``python -m lightning_nnscaler.train ARGUMENTS`` in ``cwd``, as the README runs it."""
    environment = {**os.environ, "PYTHONPATH": PYTHONPATH, "WANDB_MODE": "offline"}
    completed = subprocess.run(
        [sys.executable, "-m", "lightning_nnscaler.train", *arguments], cwd=cwd, env=environment, capture_output=True, text=True, timeout=timeout
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-5000:]
    return completed


@pytest.mark.timeout(240)
def test_default_job_trains_tp_on_two_ranks_logs_to_wandb_and_prints_a_sample(tmp_path: Path) -> None:
    """The README's first command, shortened: GPT on stdlib text, tp over 2 CPU ranks, W&B offline."""
    completed = run_app(["trainer.max_steps=20"], tmp_path, timeout=220)
    (result_file,) = tmp_path.glob("outputs/*/*/result.json")
    run_dir = result_file.parent
    result = json.loads(result_file.read_text())
    assert (result["recipe"], result["world_size"], result["steps"]) == ("tp", 2, 20)
    validation = [loss for _, loss in result["validation_losses"]]
    assert len(validation) >= 2 and validation[-1] < validation[0] - 0.2, validation
    assert result["final_train_loss"] < result["first_train_loss"] - 1.0
    assert abs(result["first_train_loss"] - math.log(256)) < 0.3  # an untrained byte model: uniform over 256 bytes
    assert "--- sample (prompt 'def '" in completed.stdout and "--- end of sample ---" in completed.stdout
    assert result["sample"].startswith("def ") and len(result["sample"].encode()) >= 100
    assert (run_dir / "plan.png").stat().st_size > 10_000
    (wandb_run,) = run_dir.glob("wandb/offline-run-*")
    assert list(wandb_run.glob("files/media/images/plan_*.png")), sorted(str(p) for p in wandb_run.rglob("*"))[:40]
    assert (run_dir / ".hydra" / "config.yaml").exists() and not list(tmp_path.glob("outputs/*/*/.hydra/*ddp*"))


@pytest.mark.timeout(180)
def test_a_three_recipe_sweep_writes_one_comparison_row_per_recipe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    """``lightning-nnscaler train -m recipe=dp,tp,coshard ...`` (the subcommand forwards Hydra's flags) at 2 ranks."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", PYTHONPATH)
    arguments = ["train", "-m", "recipe=dp,tp,coshard", "trainer.max_steps=3", "trainer.devices=2", "hydra.sweep.dir=sweep", *TINY]
    assert cli.main(arguments) == 0, capfd.readouterr().err[-5000:]
    with (tmp_path / "sweep" / "comparison.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [row["recipe"] for row in rows] == ["dp", "tp", "coshard"]
    for row in rows:
        assert row["error"] == "" and row["world_size"] == "2", row
        assert float(row["step_time_ms"]) > 0 and float(row["final_train_loss"]) < math.log(256)
        assert len(row["peak_memory_mib_per_rank"].split()) == 2 and re.fullmatch(r"[0-9a-f]{12}", row["plan_hash"])
    assert len({row["plan_hash"] for row in rows}) == 3
    assert "comparison table:" in capfd.readouterr().out


@pytest.mark.timeout(120)
def test_plan_command_prints_per_rank_parameters_equal_to_the_generated_code(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``lightning-nnscaler plan model=gpt recipe=tp world_size=8 spec=h100``: no processes; table, the
    simulated step on the H100 spec (per rank and the summary line), code and plan.png."""
    assert cli.main(["plan", "--out", str(tmp_path), "model=gpt", "recipe=tp", "world_size=8", "spec=h100"]) == 0
    printed = capsys.readouterr().out
    assert "recipe tp" in printed and "on 8 ranks" in printed
    assert "hardware spec 'h100' (spec=h100):" in printed
    rows = re.findall(r"^\s+(\d+)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s+[0-9.]+ (?:B|KiB|MiB|GiB)$", printed, re.M)
    assert [int(rank) for rank, *_ in rows] == list(range(8)) and all(float(busy) > 0 for _, busy, _, _ in rows)
    predicted = re.search(r"^predicted step on H100-SXM5-80GB: ([0-9.]+) ms \(simulated; bubble", printed, re.M)
    assert predicted and float(predicted.group(1)) > 0
    counts = {int(rank): int(count) for rank, count in re.findall(r"rank (\d+): (\d+) parameters", printed)}
    assert sorted(counts) == list(range(8))
    (code_dir,) = [path for path in tmp_path.iterdir() if path.is_dir()]
    for rank, count in counts.items():
        source = (code_dir / f"rank{rank}.py").read_text()
        held = ast.literal_eval(re.search(r"^HELD = (\{.*?^\})", source, re.S | re.M).group(1))
        boxes = [box for _, _, box, role in held.values() if role == "parameter"]
        assert count == sum(math.prod(stop - start for start, stop in box) for box in boxes), f"rank {rank}"
    assert (tmp_path / "plan.png").stat().st_size > 10_000
