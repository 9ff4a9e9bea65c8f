"""Compile time: trace + plan + materialize + codegen for GPT-2 124M.

Goals on a 2-core machine: tp=8 < 5 s; dp x tp on 128 ranks (dp=16, tp=8) < 30 s.
Run: python benchmarks/compile.py
"""

from __future__ import annotations

import time

import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.models.gpt import GPT, GPTConfig


def timed(model: GPT, batch: tuple, recipe: str, world_size: int, **params: int) -> tuple[float, dict[str, float]]:
    """Total seconds and the seconds of each stage."""
    from lightning_nnscaler.codegen import emit_rank
    from lightning_nnscaler.materialize.dependencies import materialize
    from lightning_nnscaler.plans.catalog import apply_recipe

    stages: dict[str, float] = {}
    start = time.perf_counter()
    graph = lnn.trace(model, batch, step="training_step")
    stages["trace"] = time.perf_counter() - start
    mark = time.perf_counter()
    planned = graph.copy()
    apply_recipe(planned, recipe, world_size, **params)
    stages["plan"] = time.perf_counter() - mark
    mark = time.perf_counter()
    program = materialize(planned, world_size, validate=False)  # apply_recipe validated it
    stages["materialize"] = time.perf_counter() - mark
    mark = time.perf_counter()
    for rank in range(world_size):
        emit_rank(program, rank, "benchmark", recipe)
    stages["codegen"] = time.perf_counter() - mark
    return time.perf_counter() - start, stages


def main() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig.gpt2_124m())
    batch = model.example_batch(16)
    rows = [("tp=8", "tp", 8, {}, 5.0), ("dp=16 x tp=8 (128 ranks)", "hybrid", 128, {"dp": 16, "tp": 8}, 30.0)]
    print("GPT-2 124M, batch 16, seq 1024")
    print(f"{'plan':<26} {'trace':>7} {'plan':>7} {'materialize':>12} {'codegen':>8} {'total s':>8} {'goal':>6} {'total/goal':>10}")
    for label, recipe, world_size, params, goal in rows:
        total, stages = timed(model, batch, recipe, world_size, **params)
        print(
            f"{label:<26} {stages['trace']:7.2f} {stages['plan']:7.2f} {stages['materialize']:12.2f} "
            f"{stages['codegen']:8.2f} {total:8.2f} {goal:6.1f} {total / goal:10.2f}"
        )


if __name__ == "__main__":
    main()
