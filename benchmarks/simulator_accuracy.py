"""Simulator accuracy: predicted vs measured step time and peak memory of plans run for real on gloo.

Each plan (GPT, mBART-style and Evoformer-style reference models; dp, tp, coshard, zero3, gpipe,
1f1b, interleaved, zb1, interlaced, 3f1b at 2 and 4 ranks) is planned in this process and run on fresh
gloo processes (one intra-op thread per rank, each on a core of its own where there are as many cores as ranks:
``launch(..., bind_cores=True)``): warm-up steps, then timed steps of
``forward_backward`` + AdamW ``step`` (barrier before and after; a step's time is the slowest
rank's). All plans run once per round, rounds interleaved. The prediction is compared with the median step
(the spec's communication and in-step compute are calibrated on typical, median, costs in steps) and with
the fastest. The noise floor compares the measurement with itself: each plan's steps in the even rounds
against the odd rounds', with the same two figures the goals ask of the prediction (mean absolute
difference, Kendall τ).

Measured peak memory per rank: the bytes of the tensors the rank holds between steps (parameter pieces,
the reducer's gradient buckets, the optimizer's state; gradients are set to None first, as Lightning's
``zero_grad`` does) plus the most the allocator hands out at once during a step (``sim.meter.AllocationMeter``:
saved activations, outputs not yet freed, gradients in flight, message copies, ZeRO's gathered boxes; the least of
``METERED_STEPS`` steps of every round, since the profiler cannot see a block allocated before it being freed). Predicted: the
sum of ``sim.predict``'s memory columns for the rank. Predicted step time: ``sim.predict`` with the
``cpu`` spec (``benchmarks/calibrate_comm.py``) and op times measured in one thread into a fresh
profile folder for the run. Nothing is fitted to these plans: the spec's communication figures come from
steps of a separate calibration GPT (other widths, vocab and length; ``calibrate_comm.py``).

Statistics: the op profile takes the fastest of its repeats (other processes only ever add time, as
``timeit`` advises); what a step adds to it is the spec's ``in_step_factor``, communication is
priced from its costs inside steps (``calibrate_comm.py``, ``sim.in_step``), and ranks that meet wait for
the expected latest of them (the spec's ``jitter_s``, ``sim.jitter``). gloo here is far from
steady (one all-reduce takes 0.2 ms in one call and 3 ms in the next), so the model predicts a typical
step: the median step is its measure, the fastest step (the luckiest of all) is printed beside it.

Also prints the time to simulate the 1024-GPU GPT-3 175B plan (dp 8 × tp 8 × pp 16 on A100s).

Run: python benchmarks/simulator_accuracy.py [--rounds 4] [--steps 20] [--only scale|accuracy] [--calibrate | --spec PATH] [--plan TEXT ...]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import statistics
import time

# The metered step frees blocks allocated before the profiler started, and the profiler warns of each once per
# process: quiet torch's C++ warnings in this benchmark and its ranks (set before torch is imported).
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import lightning_nnscaler as lnn
from lightning_nnscaler.codegen import module_from_source
from lightning_nnscaler.launch import launch
from lightning_nnscaler.models.evoformer import Evoformer, EvoformerConfig
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.models.mbart import MBart, MBartConfig
from lightning_nnscaler.runtime import TorchDistributedCommunicator
from lightning_nnscaler.runtime.executor import RankExecutor
from lightning_nnscaler.sim import CommModel, DeviceModel, Machine, Roofline, load_spec, predict, simulate
from lightning_nnscaler.sim.analytic import TransformerShape, transformer_task_lists
from lightning_nnscaler.sim.meter import AllocationMeter
from lightning_nnscaler.sim.profile import ProfileDB, Profiled

from calibrate_comm import calibrate  # noqa: E402 - benchmarks/ is on sys.path

PLANS: list[tuple[str, str, int, dict[str, Any]]] = [
    ("gpt", "dp", 2, {}), ("gpt", "tp", 2, {}), ("gpt", "zero3", 2, {}), ("gpt", "coshard", 2, {"shards": 2}),
    ("gpt", "gpipe", 2, {"stages": 2, "microbatches": 4}), ("gpt", "1f1b", 2, {"stages": 2, "microbatches": 4}),
    ("gpt", "interleaved", 2, {"stages": 2, "microbatches": 4}), ("gpt", "zb1", 2, {"stages": 2, "microbatches": 4}),
    ("gpt", "dp", 4, {}), ("gpt", "tp", 4, {}), ("gpt", "1f1b", 4, {"stages": 4, "microbatches": 4}),
    ("mbart", "dp", 2, {}), ("mbart", "tp", 2, {}), ("mbart", "interlaced", 2, {"stages": 2, "microbatches": 4}),
    ("evoformer", "dp", 2, {}), ("evoformer", "3f1b", 2, {"stages": 2, "microbatches": 2}),
]
METERED_STEPS = 3
"""Steps metered per rank; the least peak counts. The profiler does not see a block allocated before it started
being freed (it warns), so a step that frees one reads too high by its size, never too low: under ZeRO-3 one
metered step in three or so reads 5.3 MiB (the chunks and optimizer state) over the others."""
RANK_PRELOAD = ("lightning_nnscaler",)
"""Ranks fork from one server that imported the package once (``launch(..., preload=...)``)."""


def build_model(name: str) -> Any:
    """The reference model ``name`` with seed-0 weights (the same in every process)."""
    torch.manual_seed(0)
    if name == "gpt":
        model = GPT(GPTConfig(vocab_size=512, seq_len=64, hidden=128, layers=4, heads=4))
    elif name == "mbart":
        model = MBart(MBartConfig(vocab_size=512, seq_len=32, hidden=64, encoder_layers=2, decoder_layers=2, heads=4))
    else:
        model = Evoformer(EvoformerConfig.small())
    model.log = lambda *args, **kwargs: None
    return model


def batch_of(model: Any) -> Any:
    """Eight samples (the same in every process)."""
    return model.example_batch(8, torch.Generator().manual_seed(0))


@dataclass
class Payload:
    """What a rank needs: its code, constants, input names and offsets."""

    model: str
    sources: list[str]
    constants: dict[str, torch.Tensor]
    input_names: list[str]
    offsets: list[dict[str, int]]
    steps: int


def timed_plan(rank: int, payload: Payload) -> tuple[RankExecutor, torch.optim.Optimizer, Any]:
    """This rank's executor of the plan, its AdamW, and ``step()``: one barrier-to-barrier training step
    (forward/backward, optimizer step), returning its seconds; two untimed steps already run."""
    torch.set_num_threads(1)
    model = build_model(payload.model)
    inputs = dict(zip(payload.input_names, lnn.flatten_inputs(batch_of(model), step="training_step")))
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    module = module_from_source(payload.sources[rank], f"timed_rank{rank}")
    executor = RankExecutor(module, rank, state, payload.constants, TorchDistributedCommunicator(60.0), input_offsets=payload.offsets[rank])
    optimizer = torch.optim.AdamW(executor.parameters())

    def step() -> float:
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)  # as Lightning's loop does each step
        executor.forward_backward(inputs)
        optimizer.step()
        executor.after_optimizer_step()
        dist.barrier()
        return time.perf_counter() - start

    for _ in range(2):
        step()
    return executor, optimizer, step


def rank_main(rank: int, world_size: int, payload: Payload) -> dict[str, Any]:
    """Warm-up, timed steps, and one metered step of the plan on this rank."""
    executor, optimizer, step = timed_plan(rank, payload)
    times = [step() for _ in range(payload.steps)]
    peaks = []
    for _ in range(METERED_STEPS):
        optimizer.zero_grad(set_to_none=True)  # the step's own zero_grad would free blocks allocated before the meter, which it cannot see
        held = held_bytes(executor, optimizer)
        with AllocationMeter() as allocated:
            step()
        peaks.append(held + allocated.peak)
    return {"times": times, "memory": min(peaks)}


def held_bytes(executor: RankExecutor, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the distinct storages a rank holds between steps: parameter pieces (ZeRO chunks), gradients still
    set (the reducer's bucket buffers under stage 0, of which replicated gradients are views), the optimizer's state."""
    tensors = [shard.tensor for shard in executor.shards.values()]
    tensors += [tensor.grad for tensor in [*tensors, *executor.parameters()] if isinstance(tensor, torch.nn.Parameter) and tensor.grad is not None]
    tensors += executor.parameters()
    tensors += [value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor) and value.dim()]
    tensors += executor.reducer.bucket_buffers
    storages = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes() for tensor in tensors}
    return sum(nbytes for pointer, nbytes in storages.items() if pointer)


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's τ-a of two rankings."""
    pairs = [(i, j) for i in range(len(a)) for j in range(i + 1, len(a))]
    score = sum(np.sign(a[i] - a[j]) * np.sign(b[i] - b[j]) for i, j in pairs)
    return float(score / len(pairs)) if pairs else 1.0


def noise_floor(rows: list[dict[str, Any]]) -> str:
    """How well the measurement agrees with itself: each plan's fastest and median step in the even rounds against
    the odd rounds', as the mean absolute difference and Kendall τ (what the goals ask of the prediction)."""
    parts = []
    for label, key, combine in (("fastest", "round_fastest", min), ("median", "round_median", statistics.median)):
        even = [combine(row[key][0::2]) for row in rows]
        odd = [combine(row[key][1::2]) for row in rows]
        difference = statistics.mean(abs(a / b - 1) for a, b in zip(even, odd, strict=True))
        parts.append(f"{label} steps differ by {difference:.1%} on average, Kendall tau {kendall_tau(even, odd):.2f}")
    return ("noise floor, the even rounds against the odd rounds: " + "; ".join(parts)
            + " (a prediction cannot be checked closer than the measurement repeats)")


def scale_seconds() -> tuple[float, float, float, int]:
    """Wall seconds to build and to simulate the 1024-GPU GPT-3 175B 1F1B plan, the CPU seconds of both, and its task count.

    The CPU time is what the wall time is on an idle core; on a shared machine the wall time is longer.
    """
    spec = load_spec("a100")
    start, cpu_start = time.perf_counter(), time.process_time()
    lists = transformer_task_lists(TransformerShape(), spec, dp=8, tp=8, pp=16)
    built = time.perf_counter()
    result = simulate(lists, CommModel(spec), Machine(spec.ranks_per_node))
    done, cpu = time.perf_counter(), time.process_time() - cpu_start
    print(f"GPT-3 175B, dp 8 x tp 8 x pp 16 = 1024 A100s, 192 microbatches: predicted step {result.step_seconds:.2f} s, "
          f"bubble {result.bubble_fraction:.1%}")
    return built - start, done - built, cpu, sum(map(len, lists))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--only", choices=("scale", "accuracy"), default=None)
    parser.add_argument("--plan", action="append", default=[], metavar="TEXT",
                        help="run only the plans whose name contains TEXT (e.g. 'gpt coshard'); repeatable")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure the cpu spec first (benchmarks/calibrate_comm.py) and predict with it, not the shipped one")
    parser.add_argument("--spec", type=Path, default=None, help="predict with this spec YAML (default: the shipped cpu spec)")
    args = parser.parse_args()
    if args.only != "accuracy":
        build, run, cpu, tasks = scale_seconds()
        print(f"1024-GPU simulation: {tasks} tasks, built in {build:.1f} s and simulated in {run:.1f} s of wall time, "
              f"{cpu:.1f} s of CPU time together (goal < 10 s; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)\n")
    if args.only == "scale":
        return
    torch.set_num_threads(1)
    spec = load_spec(args.spec or "cpu")
    if args.calibrate:  # this machine's speed drifts over an hour (a VM's neighbours): measure it next to the plans
        measured = Path(tempfile.mkdtemp(prefix="lnn-spec-")) / "cpu.yaml"
        calibrate(measured)
        spec = load_spec(measured)
    database = ProfileDB.open(directory=Path(tempfile.mkdtemp(prefix="lnn-profile-")))
    device = DeviceModel(spec, Profiled(database, Roofline(spec), statistic=min))
    rows = []
    for model_name, recipe, world_size, params in PLANS:
        name = " ".join([model_name, recipe, *(f"{key}={value}" for key, value in params.items()), f"x{world_size}"])
        if args.plan and not any(text in name for text in args.plan):
            continue
        model = build_model(model_name)
        plan = lnn.parallelize(model, batch_of(model), recipe, world_size, step="training_step", **params)
        prediction = predict(plan, spec, device)
        payload = Payload(model_name, plan.sources, dict(plan.graph.constant_values), [t.name for t in plan.graph.user_inputs],
                          [plan.input_offsets(rank) for rank in range(world_size)], args.steps)
        rows.append({"name": name, "payload": payload,
                     "world": world_size, "predicted": prediction.step_seconds, "predicted_memory": prediction.peak_bytes, "rounds": []})
        print(f"planned {rows[-1]['name']}: predicted {prediction.step_seconds * 1e3:.1f} ms", flush=True)
    for round_index in range(args.rounds):
        for row in rows:
            results = launch(rank_main, row["world"], row["payload"], timeout=300.0, preload=RANK_PRELOAD, bind_cores=True)
            steps = [max(result["times"][index] for result in results) for index in range(args.steps)]
            row["rounds"] += steps
            row["round_fastest"] = [*row.get("round_fastest", []), min(steps)]
            row["round_median"] = [*row.get("round_median", []), statistics.median(steps)]
            metered = [result["memory"] for result in results]  # the least of every round's: a metered step only ever reads high
            row["memory"] = [min(pair) for pair in zip(row.get("memory", metered), metered, strict=True)]
            print(f"round {round_index}: {row['name']} fastest {min(steps) * 1e3:.1f} ms, median {statistics.median(steps) * 1e3:.1f} ms, "
                  f"predicted {row['predicted'] * 1e3:.1f} ms (load average {os.getloadavg()[0]:.1f})", flush=True)
    print(f"{'plan':<40} {'median ms':>9} {'fastest ms':>10} {'predicted ms':>12} {'vs median':>9} {'vs fastest':>10} {'memory error':>12}")
    for row in rows:
        row["measured"], row["median"] = min(row["rounds"]), statistics.median(row["rounds"])
        row["memory_error"] = max(abs(p / m - 1) for p, m in zip(row["predicted_memory"], row["memory"]))
        print(f"{row['name']:<40} {row['median'] * 1e3:>9.1f} {row['measured'] * 1e3:>10.1f} {row['predicted'] * 1e3:>12.1f} "
              f"{row['predicted'] / row['median'] - 1:>+9.1%} {row['predicted'] / row['measured'] - 1:>+10.1%} {row['memory_error']:>12.1%}")
    predicted = [row["predicted"] for row in rows]
    for label, key in (("median step", "median"), ("fastest step", "measured")):
        errors = [abs(row["predicted"] / row[key] - 1) for row in rows]
        print(f"step time vs the {label}: mean absolute error {statistics.mean(errors):.1%} (goal <= 10 %), "
              f"Kendall tau {kendall_tau([row[key] for row in rows], predicted):.2f} (goal >= 0.9)")
    if args.rounds >= 2 and len(rows) >= 2:
        print(noise_floor(rows))
    memory_errors = [row["memory_error"] for row in rows]
    print(f"peak memory per rank: mean error {statistics.mean(memory_errors):.1%}, worst {max(memory_errors):.1%} (goal within 10 %); "
          f"{len(rows)} plans, {args.rounds} rounds of {args.steps} steps, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores, "
          f"torch {torch.__version__}")


if __name__ == "__main__":
    main()
