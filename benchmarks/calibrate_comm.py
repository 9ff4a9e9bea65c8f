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
REPEATS = 9


def rank_main(rank: int, world_size: int) -> dict[str, list[tuple[int, float]]]:
    """Every (kind, size) timed on this rank: the buffer bytes and the median seconds (barrier-synced)."""
    torch.set_num_threads(1)
    communicator = TorchDistributedCommunicator(60.0)
    everyone = tuple(range(world_size))
    communicator.create_groups([everyone])
    samples: dict[tuple[str, int], list[float]] = {}
    for _ in range(REPEATS):
        for nbytes in SIZES:
            buffer = torch.randn(nbytes // 4)
            for kind in (*KINDS, "p2p"):
                dist.barrier()
                start = time.perf_counter()
                if kind == "p2p":
                    if rank == 0:
                        communicator.send(buffer, 1, 7)
                        communicator.wait_sends()
                    elif rank == 1:
                        communicator.recv(buffer.shape, buffer.dtype, 0, 7)
                elif kind == "all_reduce":
                    communicator.all_reduce(buffer, everyone)
                elif kind == "all_gather":
                    communicator.all_gather(buffer, 0, everyone)
                elif kind == "reduce_scatter":
                    communicator.reduce_scatter(buffer, 0, everyone)
                else:
                    communicator.all_to_all(buffer, 0, 0, everyone)
                samples.setdefault((kind, nbytes), []).append(time.perf_counter() - start)
    results: dict[str, list[tuple[int, float]]] = {}
    for (kind, nbytes), times in samples.items():
        results.setdefault(kind, []).append((nbytes, min(times[1:])))
    return results


def fit(world_size: int, per_rank: list[dict[str, list[tuple[int, float]]]]) -> dict[str, tuple[float, float]]:
    """α, β per kind over the ring bytes (the slowest rank's median at each size; p2p: the receiver's)."""
    fits = {}
    for kind in (*KINDS, "p2p"):
        ranks = [per_rank[1]] if kind == "p2p" else per_rank
        sizes = [nbytes for nbytes, _ in ranks[0][kind]]
        seconds = [max(dict(rank[kind])[nbytes] for rank in ranks) for nbytes in sizes]
        moved = [ring_bytes(kind, world_size, nbytes) for nbytes in sizes]
        fits[kind] = fit_alpha_beta(moved, seconds)
    return fits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=SPEC_DIRECTORY / "cpu.yaml")
    args = parser.parse_args()
    torch.set_num_threads(1)
    compute = measure_compute()
    collectives: dict[str, dict[int, list[float]]] = {}
    for world_size in (2, 4):
        for kind, (alpha, beta) in fit(world_size, launch(rank_main, world_size, timeout=300.0)).items():
            if kind == "p2p" and world_size != 2:
                continue
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
    args.output.write_text(header + yaml.safe_dump(spec, sort_keys=False))
    print(f"matmul {compute['flops'] / 1e9:.1f} GFLOP/s, copy {compute['bandwidth'] / 1e9:.1f} GB/s, op overhead "
          f"{compute['overhead'] * 1e6:.1f} us; AdamW {compute['optimizer_per_tensor'] * 1e6:.1f} us/tensor + "
          f"{compute['optimizer_per_element'] * 1e9:.2f} ns/element; wrote {args.output}")


if __name__ == "__main__":
    main()
