"""Calibrate the ``cpu`` hardware spec on this machine: compute microbenchmarks and gloo collectives.

For 2 and 4 local gloo ranks (one intra-op thread each, as the benchmarks run them), times each
collective the runtime uses (``TorchDistributedCommunicator``: all_reduce, all_gather,
reduce_scatter, all_to_all) and point-to-point messages (send on rank 0, recv on rank 1) at a few
buffer sizes, interleaved, the fastest of the repeats (on a shared machine other processes only add time); fits ``time = alpha + beta · ring bytes`` per kind and
group size (``sim.costs.ring_bytes``). One process measures matmul FLOP/s, copy bandwidth, the
per-op overhead and AdamW's step (``sim.calibrate``). Writes the spec YAML (default: the package's
``sim/specs/cpu.yaml``) and prints the fits.

Run: python benchmarks/calibrate_comm.py [--output PATH]      (about a minute on 2 cores)
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from lightning_nnscaler.launch import launch
from lightning_nnscaler.runtime import TorchDistributedCommunicator
from lightning_nnscaler.sim.calibrate import fit_alpha_beta, measure_compute
from lightning_nnscaler.sim.costs import ring_bytes
from lightning_nnscaler.sim.specs import SPEC_DIRECTORY

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
        for kind, (alpha, beta) in fit(world_size, launch(rank_main, world_size, timeout=300.0)).items():
            collectives.setdefault(kind, {})[world_size] = [alpha, beta]
            print(f"{kind:>15} p={world_size}: alpha {alpha * 1e6:8.1f} us, beta {beta * 1e9:7.3f} ns/B ({1 / beta / 1e9 if beta else float('inf'):.2f} GB/s)")
    spec = {
        "name": f"cpu ({os.cpu_count()} cores, 1 thread per rank, gloo)",
        "memory_bytes": float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
        "peak_flops": {"float32": compute["flops"]},
        "memory_bandwidth": compute["bandwidth"],
        "matmul_efficiency": 1.0, "memory_efficiency": 1.0,  # measured rates already are achieved rates
        "op_overhead_s": compute["overhead"],
        "ranks_per_node": 64,
        "cores_per_node": os.cpu_count(),
        "links": {"intra_node": {"bandwidth": 1 / collectives["p2p"][2][1], "latency": collectives["p2p"][2][0]},
                  "inter_node": {"bandwidth": 1 / collectives["p2p"][2][1], "latency": collectives["p2p"][2][0]}},
        "collectives": collectives,
        "optimizer": [compute["optimizer_per_tensor"], compute["optimizer_per_element"]],
    }
    header = "# Measured by benchmarks/calibrate_comm.py (torch %s): compute in one thread, gloo over loopback.\n" % torch.__version__
    output.write_text(header + yaml.safe_dump(spec, sort_keys=False))
    print(f"matmul {compute['flops'] / 1e9:.1f} GFLOP/s, copy {compute['bandwidth'] / 1e9:.1f} GB/s, op overhead "
          f"{compute['overhead'] * 1e6:.1f} us; AdamW {compute['optimizer_per_tensor'] * 1e6:.1f} us/tensor + "
          f"{compute['optimizer_per_element'] * 1e9:.2f} ns/element; wrote {output}")


if __name__ == "__main__":
    main()
