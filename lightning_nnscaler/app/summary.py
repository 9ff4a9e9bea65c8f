"""The comparison table that ends a sweep (``-m recipe=dp,tp,coshard``): one row per job, printed and
written to ``comparison.csv`` in the sweep folder. ``global_batch`` (samples per optimizer step over
all ranks) differs between recipes with different data-parallel replicas at one ``batch_size``: dp on
2 ranks steps on twice tp's samples, so their final losses differ for that reason too."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

COLUMNS = ("job", "recipe", "params", "world_size", "global_batch", "step_time_ms", "peak_memory_mib_per_rank", "final_train_loss", "final_val_loss", "plan_hash", "error")


def comparison_rows(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job folder of ``sweep_dir`` that holds a ``result.json``, by job number."""
    rows = []
    jobs = sorted((path.parent for path in sweep_dir.glob("*/result.json")), key=lambda path: (not path.name.isdigit(), int(path.name) if path.name.isdigit() else 0, path.name))
    for job in jobs:
        result = json.loads((job / "result.json").read_text())
        validation = result.get("validation_losses") or []
        rows.append({
            "job": job.name,
            "recipe": result.get("recipe"),
            "params": json.dumps(result.get("params") or {}, sort_keys=True),
            "world_size": result.get("world_size"),
            "global_batch": result.get("global_batch") or "",  # losses of different global batches are not comparable step for step
            "step_time_ms": _rounded(result.get("step_time_s"), 1e3),
            "peak_memory_mib_per_rank": " ".join(f"{value / 2**20:.0f}" for value in result.get("peak_memory_bytes") or []),
            "final_train_loss": _rounded(result.get("final_train_loss")),
            "final_val_loss": _rounded(validation[-1][1] if validation else None),
            "plan_hash": (result.get("plan_hash") or "")[:12],
            "error": result.get("error", ""),
        })
    return rows


def _rounded(value: Any, scale: float = 1.0) -> Any:
    return "" if value is None else round(float(value) * scale, 4)


def write_comparison(sweep_dir: Path) -> Path:
    """Print the sweep's comparison table and write it to ``sweep_dir/comparison.csv``; returns the CSV path."""
    rows = comparison_rows(sweep_dir)
    output = sweep_dir / "comparison.csv"
    with output.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    widths = {column: max([len(column), *(len(str(row[column])) for row in rows)]) for column in COLUMNS}
    print("  ".join(column.ljust(widths[column]) for column in COLUMNS))
    for row in rows:
        print("  ".join(str(row[column]).ljust(widths[column]) for column in COLUMNS))
    print(f"comparison table: {output}")
    return output


class ComparisonTable(Callback):
    """Hydra callback: after a multirun, the table of every job's ``result.json``."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Write and print the comparison of the sweep's jobs."""
        write_comparison(Path(config.hydra.sweep.dir))
