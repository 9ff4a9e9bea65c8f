"""Measuring this machine for the ``cpu`` spec: compute microbenchmarks and the α–β fit of timed messages.

Only standard ops with synthetic tensors, each timed as the fastest of several repeats after a warm-up
(on a shared machine other processes only ever add time, so the minimum is the least disturbed reading).
``benchmarks/calibrate_comm.py`` adds the gloo collectives and writes ``specs/cpu.yaml``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import torch


def timed_seconds(run: Callable[[], object], repeats: int = 7, warmup: int = 2, statistic: Callable[[list[float]], float] = min) -> float:
    """Wall time of ``run()``: ``statistic`` (default the fastest) of ``repeats`` after ``warmup`` calls."""
    for _ in range(warmup):
        run()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return statistic(samples)


def fit_alpha_beta(nbytes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``seconds ≈ alpha + beta · nbytes`` (alpha and beta clipped at 0)."""
    beta, alpha = np.polyfit(np.asarray(nbytes, dtype=float), np.asarray(seconds, dtype=float), 1)
    return max(float(alpha), 0.0), max(float(beta), 0.0)


def measure_compute() -> dict[str, float]:
    """This process's matmul FLOP/s (float32), copy bandwidth (bytes read + written per second), per-op
    overhead (a 1-element add) and the AdamW fit (seconds per tensor, per element)."""
    size = 512
    a, b = torch.randn(size, size), torch.randn(size, size)
    flops = 2 * size**3 / timed_seconds(lambda: torch.mm(a, b))
    source = torch.randn(16 * 2**20 // 4)
    target = torch.empty_like(source)
    bandwidth = 2 * source.numel() * 4 / timed_seconds(lambda: target.copy_(source))
    one = torch.ones(1)
    overhead = timed_seconds(lambda: torch.add(one, one), repeats=51)
    return {"flops": flops, "bandwidth": bandwidth, "overhead": overhead, **dict(zip(("optimizer_per_tensor", "optimizer_per_element"), _adamw_fit()))}


def _adamw_fit() -> tuple[float, float]:
    """AdamW ``step()`` on (many small tensors, one large tensor): seconds per tensor and per element."""
    def step_seconds(count: int, numel: int) -> float:
        parameters = [torch.nn.Parameter(torch.randn(numel)) for _ in range(count)]
        for parameter in parameters:
            parameter.grad = torch.randn(numel)
        optimizer = torch.optim.AdamW(parameters)
        return timed_seconds(optimizer.step, repeats=5)

    many, large = (200, 64), (1, 2**21)
    small_time, large_time = step_seconds(*many), step_seconds(*large)
    per_tensor = max(small_time - large_time * many[0] * many[1] / large[1], 0.0) / many[0]
    per_element = max(large_time - per_tensor, 0.0) / large[1]
    return per_tensor, per_element

