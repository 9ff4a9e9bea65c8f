"""Calibrate the ``cpu`` hardware spec on this machine: compute microbenchmarks, gloo collectives timed in loops
and inside training steps, and a roofline fitted to the ops of small plans.

1. One process measures matmul FLOP/s, copy bandwidth, a bare op's dispatch and AdamW's step (``sim.calibrate``).
2. For 2 and 4 local gloo ranks (one intra-op thread each, as the benchmarks run them), every collective the
   runtime uses (``TorchDistributedCommunicator``: all_reduce, all_gather, reduce_scatter, all_to_all) and an
   exchange of messages, in loops between short bursts of compute at a few buffer sizes, the fastest of the
   repeats; fitted ``time = alpha + beta · ring bytes`` per kind and group size (``sim.costs.ring_bytes``).
3. The calibration GPT (vocab 256, 32 tokens, 2 layers, 4 heads, widths 64 and 192; not a model the
   accuracy benchmark runs) trains a few steps under dp, tp, zero3 and 1f1b at 2 and 4 ranks with every
   communication operation timed where the step meets it (``sim.in_step``); where a kind and group size
   was seen at two sizes or more, its in-step fit replaces the loop's. Here that is every kind the plans
   use but all-to-all: an all-reduce costs several times its loop figure in a step, a message far less.
   The same steps give how long an issue is held while the other cores compute, how long a receive
   posted after its message was sent takes (gloo moves the message only then), how much longer a
   rank computes in a step than its ops take alone, and, in the plans that give every rank the same
   work, how far apart the ranks reach their collectives (the simulator's clock spread, ``sim.jitter``).
4. Every op of those plans is timed alone (``sim.profile``) and the roofline's per-op overhead and
   efficiency are fitted to them (``sim.calibrate.fit_roofline``): the search prices ops with the roofline.

Writes the spec YAML (default: the package's ``sim/specs/cpu.yaml``) and prints the fits.

Run: python benchmarks/calibrate_comm.py [--output PATH]      (about three minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

import lightning_nnscaler as lnn
from lightning_nnscaler.codegen import module_from_source
from lightning_nnscaler.launch import launch
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.runtime import TorchDistributedCommunicator
from lightning_nnscaler.runtime.executor import RankExecutor
from lightning_nnscaler.materialize.program import Compute
from lightning_nnscaler.sim.calibrate import RooflineFit, fit_alpha_beta, fit_roofline, measure_compute
from lightning_nnscaler.sim.costs import Roofline, ring_bytes
from lightning_nnscaler.runtime.logged_comm import Event, LoggedCommunicator
from lightning_nnscaler.sim.in_step import (
    arrival_spreads, busy_issue_seconds, communication_seconds, fit_in_step, fit_jitter, in_step_durations, late_receive_seconds,
)
from lightning_nnscaler.sim.predict import DeviceModel, predict
from lightning_nnscaler.sim.profile import ProfileDB, Profiled
from lightning_nnscaler.sim.specs import SPEC_DIRECTORY, HardwareSpec, spec_from_dict

SIZES = (4 * 2**10, 64 * 2**10, 512 * 2**10, 2 * 2**20)
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
REPEATS = 5
ITERATIONS = 20
BURST_SIZE = 160  # a matmul of about 0.3 ms in one thread: the compute between two collectives of a small step


def rank_main(rank: int, world_size: int) -> dict[str, list[tuple[int, float]]]:
    """Every (kind, size) timed on this rank as a training step meets it: between bursts of compute.

    ``ITERATIONS`` times a matmul burst then the operation, against the bursts alone; the operation's
    cost is the difference per iteration (the fastest of ``REPEATS`` such loops). Timed back to back
    after a barrier, an idle gloo rank answers at once; in a step the peer is still computing and the
    scheduler must wake the rank's communication thread first, which on a machine with as many busy
    ranks as cores costs more than the transfer itself (p2p is the exchange tensor parallelism runs:
    each rank sends, then receives; pairs 0-1 and 2-3 at once with 4 ranks)."""
    torch.set_num_threads(1)
    communicator = TorchDistributedCommunicator(60.0)
    everyone = tuple(range(world_size))
    communicator.create_groups([everyone])
    peer = rank ^ 1
    burst = torch.randn(BURST_SIZE, BURST_SIZE)
    samples: dict[tuple[str, int], list[float]] = {}

    def loop(kind: str, buffer: torch.Tensor) -> float:
        dist.barrier()
        start = time.perf_counter()
        for tag in range(ITERATIONS):
            burst @ burst
            if kind == "p2p":
                communicator.send(buffer, peer, tag)
                communicator.recv(buffer.shape, buffer.dtype, peer, tag)
            elif kind == "all_reduce":
                communicator.all_reduce(buffer, everyone)
            elif kind == "all_gather":
                communicator.all_gather(buffer, 0, everyone)
            elif kind == "reduce_scatter":
                communicator.reduce_scatter(buffer, 0, everyone)
            elif kind == "all_to_all":
                communicator.all_to_all(buffer, 0, 0, everyone)
        communicator.wait_sends()
        dist.barrier()
        return (time.perf_counter() - start) / ITERATIONS

    for _ in range(REPEATS):
        for nbytes in SIZES:
            buffer = torch.randn(nbytes // 4)
            bursts = loop("none", buffer)
            for kind in (*KINDS, "p2p"):
                samples.setdefault((kind, nbytes), []).append(loop(kind, buffer) - bursts)
    return {kind: [(nbytes, max(min(times), 0.0)) for (other, nbytes), times in samples.items() if other == kind] for kind in (*KINDS, "p2p")}


def fit(world_size: int, per_rank: list[dict[str, list[tuple[int, float]]]]) -> dict[str, tuple[float, float]]:
    """α, β per kind over the ring bytes (the slowest rank's cost at each size)."""
    fits = {}
    for kind in (*KINDS, "p2p"):
        ranks = per_rank
        sizes = [nbytes for nbytes, _ in ranks[0][kind]]
        seconds = [max(dict(rank[kind])[nbytes] for rank in ranks) for nbytes in sizes]
        moved = [ring_bytes(kind, world_size, nbytes) for nbytes in sizes]
        fits[kind] = fit_alpha_beta(moved, seconds)
    return fits


CALIBRATION_WIDTHS = (64, 192)
CALIBRATION_PLANS: list[tuple[str, int, dict[str, Any]]] = [
    (recipe, world_size, {"stages": world_size, "microbatches": 4} if recipe == "1f1b" else {})
    for world_size in (2, 4) for recipe in ("dp", "tp", "zero3", "1f1b")
]
STEPS = 20
SAME_WORK = ("dp", "tp", "zero3")
FACTOR_LEAVES_OUT = ("zero3",)
"""Calibration recipes whose ranks' time outside communication is not their ops' compute alone (``InStep.factor``)."""
"""Calibration recipes that give every rank the same work: how far apart their ranks arrive is noise (``InStep.jitter``)."""


def calibration_model(width: int) -> Any:
    """The calibration GPT (vocab 256, 32 tokens, 2 layers, 4 heads) of ``width``, seed-0 weights."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, seq_len=32, hidden=width, layers=2, heads=4))
    model.log = lambda *args, **kwargs: None
    return model


def logged_steps(rank: int, world_size: int, width: int, sources: list[str], constants: dict[str, torch.Tensor],
                 names: list[str], offsets: list[dict[str, int]]) -> list[tuple[float, float, list[Event]]]:
    """This rank's start (when it left the barrier before the step), seconds and communication events in each of
    ``STEPS`` training steps (forward/backward, AdamW; two untimed first)."""
    torch.set_num_threads(1)
    model = calibration_model(width)
    inputs = dict(zip(names, lnn.flatten_inputs(model.example_batch(8, torch.Generator().manual_seed(0)), step="training_step")))
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    communicator = LoggedCommunicator(60.0)
    executor = RankExecutor(module_from_source(sources[rank], f"calibration_rank{rank}"), rank, state, constants, communicator,
                            input_offsets=offsets[rank])
    optimizer = torch.optim.AdamW(executor.parameters())
    steps = []
    for index in range(STEPS + 2):
        communicator.events = []
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)  # as Lightning's loop (and benchmarks/simulator_accuracy.py) does each step
        executor.forward_backward(inputs)
        optimizer.step()
        executor.after_optimizer_step()
        seconds = time.perf_counter() - start
        dist.barrier()
        if index >= 2:
            steps.append((start, seconds, communicator.events))
    return steps


def calibration_plans() -> list[tuple[int, lnn.Plan]]:
    """Every ``CALIBRATION_PLANS`` plan of the calibration GPT at both widths, as ``(width, plan)``."""
    plans = []
    for width in CALIBRATION_WIDTHS:
        for recipe, world_size, params in CALIBRATION_PLANS:
            model = calibration_model(width)
            batch = model.example_batch(8, torch.Generator().manual_seed(0))
            plans.append((width, lnn.parallelize(model, batch, recipe, world_size, step="training_step", **params)))
    return plans


@dataclass
class InStep:
    """What the calibration plans' training steps measured (``sim.in_step``)."""

    fits: dict[str, dict[int, tuple[float, float]]]
    """α–β of each communication kind and group size, as the steps met them."""
    busy_issue: float
    """The mean hold of an issue while the other cores compute."""
    late_receive: dict[int, float]
    """By world size, the mean time of a receive posted after its message was sent."""
    factor: dict[int, float]
    """``in_step_factor`` by world size: the median over the plans of that many ranks but ZeRO's (whose time outside
    communication also holds the allocator's page faults for its gathered boxes, 1.4-1.8x its ops' time here,
    which is not the ops' compute), and over their ranks, of a rank's
    time outside communication (the median step's) over its compute as the spec predicts it from ops timed alone
    (``sim.profile``). More ranks than cores slow every op beyond their share of the cores."""
    median_steps: list[float]
    """Each plan's median step (of the slowest rank at each step)."""
    jitter: dict[int, tuple[float, float]]
    """By world size, ``jitter_s``: the ranks' clock spread fitted to how far apart the ranks of the plans that
    give every rank the same work (``SAME_WORK``) reach their collectives (``sim.in_step.arrival_spreads``)."""


def measure_in_step(plans: list[tuple[int, lnn.Plan]], spec: HardwareSpec) -> InStep:
    """Train ``plans`` a few steps on gloo ranks with every communication operation logged; see ``InStep``."""
    samples: dict[tuple[str, int], list[tuple[int, float]]] = {}
    spreads: dict[int, list[tuple[float, float]]] = {}
    ratios: dict[int, list[float]] = {}
    median_steps = []
    with tempfile.TemporaryDirectory(prefix="lnn-profile-") as folder:
        device = DeviceModel(spec, Profiled(ProfileDB.open(directory=Path(folder)), Roofline(spec), statistic=min))
        for width, plan in plans:
            offsets = [plan.input_offsets(rank) for rank in range(plan.world_size)]
            names = [tensor.name for tensor in plan.graph.user_inputs]
            per_rank = launch(logged_steps, plan.world_size, width, plan.sources, dict(plan.graph.constant_values), names, offsets,
                              timeout=300.0, preload=("lightning_nnscaler",), bind_cores=True)
            for step in zip(*per_rank, strict=True):
                rank_events = [events for _, _, events in step]
                for key, points in in_step_durations(rank_events, cores=os.cpu_count()).items():
                    samples.setdefault(key, []).extend(points)
                if plan.recipe in SAME_WORK:
                    starts = [start for start, _, _ in step]
                    ends = [start + seconds for start, seconds, _ in step]
                    spreads.setdefault(plan.world_size, []).extend(arrival_spreads(rank_events, starts, ends))
            predicted = predict(plan, spec, device).simulation.ranks
            for rank, steps in enumerate(per_rank if plan.recipe not in FACTOR_LEAVES_OUT else []):
                outside = statistics.median(seconds - communication_seconds(events) for _, seconds, events in steps)
                ratios.setdefault(plan.world_size, []).append(outside / predicted[rank].busy)
            median_steps.append(statistics.median(max(seconds for _, seconds, _ in step) for step in zip(*per_rank, strict=True)))
    factor = {world_size: statistics.median(values) for world_size, values in sorted(ratios.items())}
    jitter = {world_size: fit_jitter(points) for world_size, points in sorted(spreads.items())}
    return InStep(fit_in_step(samples), busy_issue_seconds(samples), late_receive_seconds(samples), factor, median_steps, jitter)


def mean_error(spec: HardwareSpec, chosen: list[tuple[lnn.Plan, float]], device: DeviceModel) -> float:
    """Mean absolute error of ``spec``'s predicted steps (op times from ``device``) against ``(plan, median step)`` pairs."""
    return statistics.fmean(abs(predict(plan, spec, device).step_seconds / measured - 1) for plan, measured in chosen)


def keep_jitter_that_helps(spec: dict[str, Any], plans: list[tuple[int, lnn.Plan]], median_steps: list[float],
                           device: DeviceModel) -> dict[int, list[float]]:
    """``spec``'s measured ``jitter_s``, world size by world size (fewest ranks first), where it predicts that many
    ranks' calibration plans closer (mean absolute error of their median steps) than what the spec gives them
    without it: the entry of fewer ranks (``sim.specs.measured_for``), or none. On 4 ranks sharing 2 cores the
    measured spread (1.5 ms at every meeting) priced those plans 22 % off, against 15 % with the 2-rank figure
    and 16 % with none (presumably the collectives' in-step costs there already hold the ranks' time slicing)."""
    kept: dict[int, list[float]] = {}
    for world_size, fit in sorted(spec.get("jitter_s", {}).items()):
        chosen = [(plan, measured) for (_, plan), measured in zip(plans, median_steps, strict=True) if plan.world_size == world_size]
        measured_error = mean_error(spec_from_dict({**spec, "jitter_s": {**kept, world_size: fit}}, "calibrated"), chosen, device)
        otherwise_error = mean_error(spec_from_dict({**spec, "jitter_s": kept}, "calibrated"), chosen, device)
        otherwise = f"with the {max(kept)}-rank one" if kept else "without"
        better = measured_error < otherwise_error
        print(f"{world_size} ranks: calibration plans {measured_error:.1%} off with their measured jitter, {otherwise_error:.1%} "
              f"{otherwise}: {'kept' if better else 'left out'}")
        if better:
            kept[world_size] = fit
    return kept


def print_residuals(spec: HardwareSpec, plans: list[tuple[int, lnn.Plan]], median_steps: list[float], device: DeviceModel) -> None:
    """Each calibration plan's median step against what the calibrated ``spec`` predicts (op times from ``device``)."""
    for (width, plan), measured in zip(plans, median_steps, strict=True):
        predicted = predict(plan, spec, device).step_seconds
        label = " ".join([f"width {width}", plan.recipe, *(f"{key}={value}" for key, value in plan.params.items()), f"x{plan.world_size}"])
        print(f"{label:<44} median step {measured * 1e3:6.1f} ms, predicted {predicted * 1e3:6.1f} ms ({predicted / measured - 1:+.0%})")
    print(f"calibration plans: mean absolute error {mean_error(spec, [(plan, measured) for (_, plan), measured in zip(plans, median_steps, strict=True)], device):.1%}")


def roofline_fit(spec: HardwareSpec, plans: list[tuple[int, lnn.Plan]]) -> RooflineFit:
    """Per-op overhead and efficiency of the roofline fitted to every op of every rank of ``plans``, each timed
    alone in this process (``sim.profile``, fastest repeats; ``sim.calibrate.fit_roofline``)."""
    with tempfile.TemporaryDirectory(prefix="lnn-profile-") as folder:
        profiled = Profiled(ProfileDB.open(directory=Path(folder)), Roofline(spec), statistic=min)
        ops = [action.op for _, plan in plans for program in plan.materialized.ranks for action in program.actions
               if isinstance(action, Compute)]
        return fit_roofline(spec, ops, [profiled.op_time(op) for op in ops])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=SPEC_DIRECTORY / "cpu.yaml")
    calibrate(parser.parse_args().output)


def calibrate(output: Path) -> None:
    """Measure this machine and write its spec YAML to ``output`` (see the module docstring)."""
    torch.set_num_threads(1)
    compute = measure_compute()
    collectives: dict[str, dict[int, list[float]]] = {}
    for world_size in (2, 4):
        for kind, (alpha, beta) in fit(world_size, launch(rank_main, world_size, timeout=300.0, bind_cores=True)).items():
            collectives.setdefault(kind, {})[world_size] = [alpha, beta]
    loop_p2p = collectives["p2p"][2]  # the links (the fallback for what no table entry covers) keep the loop's figures
    spec = {
        "name": f"cpu ({os.cpu_count()} cores, 1 thread per rank, gloo)",
        "memory_bytes": float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
        "peak_flops": {"float32": compute["flops"]},
        "memory_bandwidth": compute["bandwidth"],
        "matmul_efficiency": 1.0, "memory_efficiency": 1.0,  # fitted below (roofline_fit)
        "op_overhead_s": compute["overhead"],
        "ranks_per_node": 64,
        "cores_per_node": os.cpu_count(),
        "links": {"intra_node": {"bandwidth": 1 / loop_p2p[1], "latency": loop_p2p[0]},
                  "inter_node": {"bandwidth": 1 / loop_p2p[1], "latency": loop_p2p[0]}},
        "collectives": collectives,
        "optimizer": [compute["optimizer_per_tensor"], compute["optimizer_per_element"]],
    }
    plans = calibration_plans()
    measured = measure_in_step(plans, spec_from_dict(spec, "measured"))
    for kind, by_size in measured.fits.items():
        for world_size, (alpha, beta) in by_size.items():
            collectives.setdefault(kind, {})[world_size] = [alpha, beta]
    fitted = roofline_fit(spec_from_dict(spec, "measured"), plans)
    spec.update(op_overhead_s=fitted.overhead, matmul_efficiency=fitted.matmul_efficiency, memory_efficiency=fitted.memory_efficiency, busy_issue_s=measured.busy_issue,
                late_receive_s=measured.late_receive, in_step_factor=measured.factor,
                jitter_s={world_size: list(fit) for world_size, fit in measured.jitter.items()})
    for kind, by_size in collectives.items():
        for world_size, (alpha, beta) in sorted(by_size.items()):
            where = "in steps" if world_size in measured.fits.get(kind, {}) else "in loops"
            print(f"{kind:>15} p={world_size} ({where}): alpha {alpha * 1e6:8.1f} us, beta {beta * 1e9:7.3f} ns/B")
    late = ", ".join(f"{seconds * 1e6:.0f} us at {ranks} ranks" for ranks, seconds in sorted(measured.late_receive.items()))
    factors = ", ".join(f"{factor:.2f}x at {ranks} ranks" for ranks, factor in measured.factor.items())
    spreads = ", ".join(f"{seconds * 1e3:.2f} ms + {share:.2f} x its compute at {ranks} ranks" for ranks, (seconds, share) in measured.jitter.items())
    print(f"issuing while the other cores compute holds a rank {measured.busy_issue * 1e6:.1f} us on average; a receive posted after its "
          f"message was sent takes {late or 'nothing measured'}; in a step a rank computes {factors} as long as its ops "
          f"timed alone; roofline fitted to those ops: {fitted.overhead * 1e6:.1f} us per op, {fitted.matmul_efficiency:.2f} of the peak "
          f"FLOP/s in matmuls, {fitted.memory_efficiency:.2f} of the bandwidth elsewhere; a rank's clock spreads by {spreads}")
    with tempfile.TemporaryDirectory(prefix="lnn-profile-") as folder:  # the plans' ops timed once for both
        calibrated = spec_from_dict(spec, "calibrated")
        device = DeviceModel(calibrated, Profiled(ProfileDB.open(directory=Path(folder)), Roofline(calibrated), statistic=min))
        spec["jitter_s"] = keep_jitter_that_helps(spec, plans, measured.median_steps, device)
        print_residuals(spec_from_dict(spec, "calibrated"), plans, measured.median_steps, device)
    header = "# Measured by benchmarks/calibrate_comm.py (torch %s): compute in one thread, gloo over loopback.\n" % torch.__version__
    output.write_text(header + yaml.safe_dump(spec, sort_keys=False))
    print(f"matmul {compute['flops'] / 1e9:.1f} GFLOP/s, copy {compute['bandwidth'] / 1e9:.1f} GB/s, op overhead "
          f"{compute['overhead'] * 1e6:.1f} us; AdamW {compute['optimizer_per_tensor'] * 1e6:.1f} us/tensor + "
          f"{compute['optimizer_per_element'] * 1e9:.2f} ns/element; wrote {output}")


if __name__ == "__main__":
    main()
