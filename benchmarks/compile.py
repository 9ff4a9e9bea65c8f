"""Compile time: trace + plan + materialize + codegen for GPT-2 124M, one rank's planning at scale, and op_order at scale.

Goals on a 2-core machine: tp=8 < 5 s; dp x tp on 128 ranks (dp=16, tp=8) < 30 s; one rank's planning of
hybrid3d (dp x tp 4 x pp 4, sequence 128) < 5 s at 128 ranks and < 30 s at 1024; a pipeline schedule over a
~35k-piece plan added with one op_orders call, not one re-sort per edge.
Run: python benchmarks/compile.py [--only compile|rank|op_order] [--replicas 8,64]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
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


def compile_table() -> None:
    """Seconds per compile stage for GPT-2 124M, tp=8 and dp=16 x tp=8."""
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


RANK_GOALS = {128: 5.0, 1024: 30.0}  # seconds for one rank's planning, by world size (issue 35)


def one_rank_seconds(replicas: int) -> dict[str, float]:
    """Seconds of each stage of rank 0's ``parallelize`` of GPT-2 124M (sequence 128, 4 rows per replica, so 4
    microbatches) with ``hybrid3d`` at dp ``replicas`` × tp 4 × pp 4: what one process of that job plans."""
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(GPTConfig.gpt2_124m(), seq_len=128))
    batch = model.example_batch(4 * replicas)
    stages: dict[str, float] = {}

    def record(line: str) -> None:
        if ": done in " in line:
            what, seconds = line.rsplit(": done in ", 1)
            stages[what.split()[0]] = float(seconds.split()[0])

    start, cpu = time.perf_counter(), time.process_time()
    lnn.parallelize(model, batch, "hybrid3d", 16 * replicas, step="training_step", dp=replicas, tp=4, pp=4, rank=0, progress=record)
    stages["total"] = time.perf_counter() - start
    stages["cpu"] = time.process_time() - cpu  # what the wall time would be on an idle core (the machine may be shared)
    return stages


def rank_table(replicas: list[int]) -> None:
    """One rank's planning seconds per world size (each in a fresh process), and the growth from the first to the last."""
    print("one rank's planning: GPT-2 124M, sequence 128, hybrid3d dp x tp 4 x pp 4, 4 microbatches, rank 0")
    print(f"{'ranks':>6} {'tracing':>8} {'planning':>9} {'materializing':>14} {'total s':>8} {'cpu s':>6} {'goal':>6}")
    totals = []
    for count in replicas:
        output = subprocess.run(
            [sys.executable, __file__, "--one-rank", str(count)], check=True, capture_output=True, text=True,
        ).stdout
        stages = json.loads(output.strip().splitlines()[-1])
        ranks = 16 * count
        goal = RANK_GOALS.get(ranks)
        totals.append((ranks, stages["cpu"]))
        print(
            f"{ranks:6d} {stages['tracing']:8.1f} {stages['planning']:9.1f} {stages['materializing']:14.1f} {stages['total']:8.1f} "
            f"{stages['cpu']:6.1f} {goal if goal else '':>6}"
        )
    if len(totals) > 1:
        (first, first_total), (last, last_total) = totals[0], totals[-1]
        print(f"growth {first} -> {last} ranks: x{last_total / first_total:.1f} CPU time for x{last / first:.0f} ranks")


OP_ORDER_COMPLEXITY = (
    "op_orders(graph, edges): O(k) to add k edges + one stable_topological_order, O((V + E) log V) for V ops and"
    " E edges (order edges + data dependencies; data dependencies found in O(R log B) for R pieces read and"
    " B pieces per tensor, when pieces tile a dim); op_order per edge: k re-sorts, O(k (V + E) log V)"
)


def pipeline_plan(layers: int, stages: int = 4, microbatches: int = 8) -> tuple[lnn.Graph, list[tuple[str, str]]]:
    """A small-width GPT of ``layers`` layers cut into microbatch pieces, stage ``s`` on device ``s``, and
    the edges of a schedule that runs each device's segments microbatch after microbatch.

    forward(s, mb) is the mb-th piece of every op of stage s (a contiguous range of ops); its ops run in a
    chain, and its last op runs before the first op of forward(s, mb + 1): about one edge per piece.
    Replicated ops (the batch split does not reach them) and ops whose pieces read other microbatches' pieces
    (the loss summed over microbatches) are left to the data dependencies.
    """
    from lightning_nnscaler.ir.validate import data_dependencies
    from lightning_nnscaler.plans.dp import split_batch

    torch.manual_seed(0)
    model = GPT(dataclasses.replace(GPTConfig.small(), layers=layers))
    graph = lnn.trace(model, model.example_batch(microbatches), step="training_step")
    pieces_per_op = split_batch(graph, microbatches)
    reads = data_dependencies(graph)
    pieces_per_op = [pieces for pieces in pieces_per_op if _microbatch_local(pieces, reads)]
    edges = []
    for stage in range(stages):
        ops = pieces_per_op[stage * len(pieces_per_op) // stages : (stage + 1) * len(pieces_per_op) // stages]
        for pieces in ops:
            for piece in pieces:
                lnn.op_assign(graph, piece, stage)
        sequence = [pieces[microbatch].name for microbatch in range(microbatches) for pieces in ops]
        edges += list(zip(sequence, sequence[1:]))
    return graph, edges


def _microbatch_local(pieces: list[lnn.Op], reads: dict[str, list[str]]) -> bool:
    """Whether the pieces of an op write distinct batch slices and piece ``mb`` reads only pieces ``mb``
    of other ops (pieces are named ``<op>.<mb>``)."""
    distinct = len({piece.outputs[0].index for piece in pieces}) == len(pieces)
    return distinct and all(producer.endswith(f".{mb}") for mb, piece in enumerate(pieces) for producer in reads[piece.name])


def op_order_row(layers: int, sampled_edges: int) -> tuple[int, int, float, float, float]:
    """Pieces, edges, seconds of one op_orders call, seconds per op_order call (over the first
    ``sampled_edges`` edges) and that per-edge time times the edges (a lower bound: later calls
    re-sort more edges)."""
    from lightning_nnscaler.primitives import op_order, op_orders

    graph, edges = pipeline_plan(layers)
    at_once = graph.copy()
    start = time.perf_counter()
    op_orders(at_once, edges)
    once = time.perf_counter() - start
    one_by_one = graph.copy()
    start = time.perf_counter()
    for before, after in edges[:sampled_edges]:
        op_order(one_by_one, before, after)
    per_edge = (time.perf_counter() - start) / sampled_edges
    return len(graph.ops), len(edges), once, per_edge, per_edge * len(edges)


def op_order_table() -> None:
    """op_orders once vs op_order per edge, for a ~4k-piece and a ~35k-piece pipeline plan."""
    print("op_order at scale: GPT (width 32, seq 16) x 8 microbatches x 4 stages, schedule edges = one chain per device")
    print(f"complexity: {OP_ORDER_COMPLEXITY}")
    print(f"{'pieces':>7} {'edges':>7} {'op_orders s':>12} {'op_order s/edge':>16} {'per edge x edges s':>19} {'ratio':>8}")
    for layers, sampled_edges in ((22, 16), (196, 4)):
        pieces, edges, once, per_edge, one_by_one = op_order_row(layers, sampled_edges)
        print(f"{pieces:7d} {edges:7d} {once:12.2f} {per_edge:16.3f} {one_by_one:19.0f} {one_by_one / once:8.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("compile", "rank", "op_order"), help="run one table (default: all)")
    parser.add_argument("--replicas", default="8,64", help="data-parallel replicas of the rank table (x 16 ranks each)")
    parser.add_argument("--one-rank", type=int, help=argparse.SUPPRESS)  # a fresh process of rank_table: prints JSON
    arguments = parser.parse_args()
    if arguments.one_rank is not None:
        print(json.dumps(one_rank_seconds(arguments.one_rank)))
        return
    only = arguments.only
    if only in (None, "compile"):
        compile_table()
    if only in (None, "rank"):
        rank_table([int(count) for count in arguments.replicas.split(",")])
    if only in (None, "op_order"):
        op_order_table()


if __name__ == "__main__":
    main()
