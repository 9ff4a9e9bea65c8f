"""Checks and calibrates the shipped spec of the GPU this runs on (``sim/specs/h100.yaml`` on an H100,
``h200.yaml`` on an H200): ops and a GPT step, predicted next to measured (CUDA events, median of repeats).

Ops: fp32, TF32 and bf16 matmuls (compute bound) and fp32 / bf16 adds over 2^28 elements (memory bound),
predicted by the spec's roofline. GPT step: GPT-2 124M shapes (seq 1024, batch 8, no TF32), forward +
backward + AdamW on one GPU, in fp32 and in pure bf16, predicted by ``sim.predict`` of its one-rank plan
three ways: the shipped spec's roofline; the roofline calibrated here (``sim.calibrate.fit_roofline``
over the step's ops each timed alone on the GPU by ``sim.profile``); and those profiled op times
themselves. Peak memory: ``predict``'s per-rank total against ``torch.cuda.max_memory_allocated`` over
a step once AdamW's state exists. ``--output`` writes the calibrated spec (a YAML ``load_spec`` reads).

Run on a GPU machine: python benchmarks/gpu_spec_check.py [--spec h100] [--output calibrated.yaml]
(``--device cpu --model small`` runs the script's code paths on a CPU, for checking the script only.)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch
import yaml

import lightning_nnscaler as lnn
from lightning_nnscaler.materialize.program import Compute
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.sim import load_spec, predict
from lightning_nnscaler.sim.calibrate import fit_roofline
from lightning_nnscaler.sim.costs import Roofline, roofline_seconds
from lightning_nnscaler.sim.predict import DeviceModel
from lightning_nnscaler.sim.profile import ProfileDB, Profiled
from lightning_nnscaler.sim.specs import HardwareSpec, spec_for_device

REPEATS = 10
MODELS = {
    "gpt2": GPTConfig(vocab_size=50257, seq_len=1024, hidden=768, layers=12, heads=12),  # GPT-2 124M shapes
    "small": GPTConfig(vocab_size=512, seq_len=64, hidden=64, layers=2, heads=4),
}
BATCH = 8


def device_seconds(fn: Callable[[], object], device: str, repeats: int = REPEATS) -> float:
    """Median seconds of ``fn()`` after two warm-ups (CUDA events on a GPU, the wall clock on a CPU)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def op_rows(spec: HardwareSpec, device: str, n: int, elements: int) -> list[tuple[str, float, float]]:
    """(name, predicted, measured seconds) of matmuls and adds on ``device`` by ``spec``'s roofline."""
    rows = []
    for dtype, tf32 in ((torch.float32, False), (torch.float32, True), (torch.bfloat16, False)):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        name = "tf32" if tf32 else str(dtype).removeprefix("torch.")
        predicted = spec.op_overhead_s + roofline_seconds(spec, 2 * n**3, 3 * n * n * a.element_size(), name, matmul=True)
        rows.append((f"matmul {n}^3 {name}", predicted, device_seconds(lambda: a @ b, device)))
    torch.backends.cuda.matmul.allow_tf32 = False
    for dtype in (torch.float32, torch.bfloat16):
        x, y = (torch.randn(elements, device=device, dtype=dtype) for _ in range(2))
        name = str(dtype).removeprefix("torch.")
        predicted = spec.op_overhead_s + roofline_seconds(spec, elements, 3 * elements * x.element_size(), name, matmul=False)
        rows.append((f"add {elements} {name}", predicted, device_seconds(lambda: x + y, device)))
    return rows


def measured_step(model: GPT, batch: tuple[torch.Tensor, ...], device: str) -> tuple[float, int]:
    """Median seconds of an eager forward + backward + AdamW step, and the peak bytes allocated over one step."""
    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    device_batch = tuple(tensor.to(device) for tensor in batch)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model.training_step(device_batch, 0).backward()
        optimizer.step()

    seconds = device_seconds(step, device)
    if device != "cuda":
        return seconds, 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return seconds, torch.cuda.max_memory_allocated()


def check_step(config: GPTConfig, dtype: torch.dtype, spec: HardwareSpec, device: str) -> tuple[list[tuple[str, float, float]], HardwareSpec]:
    """Rows for one GPT step in ``dtype`` (three predictions against the measured time, memory) and the spec
    calibrated to the step's ops timed alone on ``device``."""
    torch.manual_seed(0)
    model = GPT(config).to(dtype)
    batch = model.example_batch(BATCH, torch.Generator().manual_seed(1))
    plan = lnn.parallelize(model, batch, "dp", 1, step="training_step")
    with tempfile.TemporaryDirectory(prefix="lnn-profile-") as folder:
        profiled = Profiled(ProfileDB.open(device, directory=Path(folder)), Roofline(spec), device=device)
        ops = [action.op for action in plan.materialized.ranks[0].actions if isinstance(action, Compute)]
        fitted = fit_roofline(spec, ops, [profiled.op_time(op) for op in ops])
        calibrated = replace(spec, op_overhead_s=fitted.overhead, matmul_efficiency=fitted.matmul_efficiency, memory_efficiency=fitted.memory_efficiency)
        predictions = {
            "shipped roofline": predict(plan, spec),
            "calibrated roofline": predict(plan, calibrated),
            "ops timed alone": predict(plan, spec, DeviceModel(spec, profiled)),
        }
    seconds, peak = measured_step(model, batch, device)
    name = f"GPT step {str(dtype).removeprefix('torch.')} batch {BATCH}"
    rows = [(f"{name}, {how}", prediction.step_seconds, seconds) for how, prediction in predictions.items()]
    predicted_peak = max(predictions["shipped roofline"].peak_bytes)
    memory = f"peak memory predicted {predicted_peak / 2**20:.0f} MiB, measured {peak / 2**20:.0f} MiB ({predicted_peak / peak:.3f})" if peak else ""
    print(f"{name}: {len(ops)} ops; roofline fitted to their kernels: {fitted.overhead * 1e6:.1f} us per op, matmul efficiency "
          f"{fitted.matmul_efficiency:.3f}, memory efficiency {fitted.memory_efficiency:.3f}; {memory}")
    return rows, calibrated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", help="shipped spec name or YAML path (default: the spec matching the GPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt2")
    parser.add_argument("--output", type=Path, help="write the spec calibrated to the fp32 step's ops here")
    args = parser.parse_args()
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    spec_name, note = (args.spec, "") if args.spec else spec_for_device(device_name)
    spec = load_spec(spec_name)
    print(f"device: {device_name}; spec {spec.name} {note}; torch {torch.__version__}")
    small = args.model == "small"
    rows = op_rows(spec, args.device, 256 if small else 4096, 2**16 if small else 2**28)
    calibrated = spec
    for dtype in (torch.float32, torch.bfloat16):
        step_rows, fitted = check_step(MODELS[args.model], dtype, spec, args.device)
        rows += step_rows
        calibrated = fitted if dtype is torch.float32 else calibrated
    print(f"{'what':<56} {'predicted ms':>13} {'measured ms':>12} {'pred/meas':>10}")
    for name, predicted, measured in rows:
        print(f"{name:<56} {predicted * 1000:>13.3f} {measured * 1000:>12.3f} {predicted / measured:>10.2f}")
    if args.output:
        data = {key: value for key, value in asdict(calibrated).items() if value not in (None, {}, 0.0) or key == "op_overhead_s"}
        data["links"] = {"intra_node": asdict(calibrated.intra_node), "inter_node": asdict(calibrated.inter_node)}
        data.pop("intra_node"), data.pop("inter_node")
        header = f"# {spec.name} calibrated on {device_name} by benchmarks/gpu_spec_check.py (torch {torch.__version__})\n"
        args.output.write_text(header + yaml.safe_dump(data, sort_keys=False))
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
