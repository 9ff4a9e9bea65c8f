"""Measuring this machine for the ``cpu`` spec: compute microbenchmarks and the α–β fit of timed messages.

Only standard ops with synthetic tensors, each timed as the fastest of several repeats after a warm-up
(on a shared machine other processes only ever add time, so the minimum is the least disturbed reading).
``benchmarks/calibrate_comm.py`` adds the gloo collectives and writes ``specs/cpu.yaml``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import NamedTuple

import numpy as np
import torch

from lightning_nnscaler.ir.op import Op
from lightning_nnscaler.sim.costs import VIEWS, OpTime, op_work
from lightning_nnscaler.sim.specs import HardwareSpec


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


def fit_alpha_beta(nbytes: Sequence[float], seconds: Sequence[float], counts: Sequence[int] | None = None) -> tuple[float, float]:
    """Least-squares ``seconds ≈ alpha + beta · nbytes`` (alpha and beta clipped at 0); ``counts``: how many
    samples each point stands for (its weight), else all alike."""
    weights = None if counts is None else np.sqrt(np.asarray(counts, dtype=float))
    beta, alpha = np.polyfit(np.asarray(nbytes, dtype=float), np.asarray(seconds, dtype=float), 1, w=weights)
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


class RooflineFit(NamedTuple):
    """What ``fit_roofline`` finds: the per-op overhead and the shares of the peak rates reached."""

    overhead: float
    matmul_efficiency: float
    memory_efficiency: float


def fit_roofline(spec: HardwareSpec, ops: Sequence[Op], measured: Sequence[OpTime]) -> RooflineFit:
    """The per-op overhead, matmul efficiency (share of peak FLOP/s) and memory efficiency (share of bandwidth)
    that make ``spec``'s roofline best match ``measured`` times of ``ops`` (forward, and backward at twice the
    work), by least squares on the seconds (what a step adds up); view-like ops, which move nothing, are left out.

    Each op counts toward the rate that bounds it at the peak rates (a matmul's FLOPs, or bytes); an efficiency
    no op is bound by stays ``spec``'s. One figure for both would misprice a GPU, where large matmuls reach
    about 0.7 of peak while small elementwise kernels reach far less of the bandwidth.

    A bare one-element add gives the dispatch alone; an op inside a model also allocates its output, records
    autograd's node, and runs at small shapes below the peak rates of a large matmul: the roofline priced
    with those figures misses per-rank op costs of a small model by a third here, and more for plans with
    more, smaller ops (an interleaved pipeline's), which is what ranks plans wrongly.
    """
    alone = replace(spec, op_overhead_s=0.0, matmul_efficiency=1.0, memory_efficiency=1.0)
    rows, targets = [], []
    for op, times in zip(ops, measured, strict=True):
        if op.target in VIEWS:
            continue
        work = op_work(op)
        compute = work.flops / alone.flops(work.dtype)
        memory = work.nbytes / alone.memory_bandwidth
        matmul_bound = work.matmul and compute >= memory
        for multiple, seconds in ((1.0, times.forward), (2.0, times.backward if work.has_backward else 0.0)):
            if seconds > 0:
                rows.append((1.0, multiple * compute if matmul_bound else 0.0, 0.0 if matmul_bound else multiple * max(compute, memory)))
                targets.append(seconds)
    matrix, target = np.asarray(rows), np.asarray(targets)
    used = [column for column in (1, 2) if matrix[:, column].any()]
    (overhead, *slowdowns), *_ = np.linalg.lstsq(matrix[:, [0, *used]], target, rcond=None)
    if overhead < 0:  # no fixed cost: fit the rates alone
        overhead, (slowdowns, *_) = 0.0, np.linalg.lstsq(matrix[:, used], target, rcond=None)
    efficiency = {1: spec.matmul_efficiency, 2: spec.memory_efficiency}
    efficiency.update({column: 1.0 / max(float(slowdown), 1e-3) for column, slowdown in zip(used, slowdowns)})
    return RooflineFit(max(float(overhead), 0.0), efficiency[1], efficiency[2])
