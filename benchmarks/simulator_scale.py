"""Simulator scale: a dp × tp × pp step of a paper-sized model rank by rank against one rank per stage.

``sim.cluster.simulate_plan`` on the analytic transformer (``sim.analytic``): ``symmetric=False`` builds and
simulates every rank's task list; the default simulates one representative per pipeline stage and lets it stand
for the stage's replicas and tp peers (``sim.symmetric``), with the same result. The wall seconds are the build
and the simulation together (the fastest of ``--repeats``; rank by rank once, it takes seconds). Plans:

- GPT-3 175B (96 blocks, hidden 12288, 2048 tokens; batch 1536), dp 8 × tp 8 × pp 16 on 1024 A100s: 192
  microbatches per replica.
- Llama-3-405B-like (128 blocks, the paper's 126 rounded up so 16 stages divide them; hidden 16384, 8192 tokens,
  vocab 128256, 128 heads; batch 2048 sequences, 16M tokens, as Llama 3's pre-training), tp 8 × pp 16 × dp 128 on
  16,384 H100s: 16 microbatches per replica; and the same plan at batch 16,384 (128 microbatches), where rank by
  rank would build 17M tasks and is not run.
- The calibrated recipes (``benchmarks/simulator_paper_scale.py``): GPT-3 175B on 1024 A100s as Narayanan et al.
  ran their 145B–310B class (full recompute), and Llama 3 405B on 16,384 H100s as the paper-scale calibration
  predicts it (interleaved × 4, selective recompute, sp, ZeRO-1, overlapped gradient reduction): 4 × the tasks of
  plain 1F1B per stage.

Every plan is priced on its spec's large-run terms (``sim.large_run.cluster_spec``), as the analytic path prices.

Run: python benchmarks/simulator_scale.py [--repeats 3] [--skip-rank-by-rank]
"""

from __future__ import annotations

import argparse
import os
import time

from lightning_nnscaler.sim.analytic import TransformerShape, transformer_task_lists
from lightning_nnscaler.sim.cluster import ClusterPlan, simulate_plan
from lightning_nnscaler.sim.large_run import cluster_spec

GPT3 = TransformerShape()
LLAMA3_405B = TransformerShape(layers=128, hidden=16384, seq_len=8192, vocab=128256, heads=128, global_batch=2048)
PLANS = [  # (name, shape, plan, spec, run rank by rank)
    ("GPT-3 175B", GPT3, ClusterPlan(dp=8, tp=8, pp=16, microbatch_size=1), "a100", True),
    ("Llama-3-405B-like", LLAMA3_405B, ClusterPlan(dp=128, tp=8, pp=16, microbatch_size=1), "h100", True),
    ("Llama-3-405B-like, batch 16384", TransformerShape(**{**LLAMA3_405B.__dict__, "global_batch": 16384}),
     ClusterPlan(dp=128, tp=8, pp=16, microbatch_size=1), "h100", False),
    ("GPT-3 175B, full recompute", GPT3, ClusterPlan(dp=8, tp=8, pp=16, microbatch_size=1, recompute="full"), "a100", False),
    ("Llama-3-405B-like, as calibrated", LLAMA3_405B,
     ClusterPlan(dp=128, tp=8, pp=16, microbatch_size=1, recompute="selective", zero1=True, sequence_parallel=True, virtual_stages=4,
                 overlap_grad_reduce=True), "h100", False),
]


def timed(function, repeats: int):
    """The fastest wall seconds of ``repeats`` calls of ``function``, and its last result."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = function()
        best = min(best, time.perf_counter() - start)
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="symmetric runs per plan (the fastest is shown)")
    parser.add_argument("--skip-rank-by-rank", action="store_true")
    args = parser.parse_args()
    print(f"{'GPUs':>6}  {'plan':<120} {'tasks (every rank / symmetric)':>31}  {'rank by rank':>12}  {'symmetric':>9}  "
          f"{'ratio':>6}  step")
    for name, shape, plan, spec_name, every_rank in PLANS:
        spec = cluster_spec(spec_name)
        world = plan.dp * plan.tp * plan.pp
        layout = {"dp": plan.dp, "tp": plan.tp, "pp": plan.pp}
        symmetric_tasks = sum(map(len, transformer_task_lists(shape, spec, **layout, representatives=True, recipe=plan)))
        fast, result = timed(lambda: simulate_plan(shape, spec, plan), args.repeats)
        slow_text, ratio_text, tasks_text, agree = "-", "-", "-", ""
        if every_rank and not args.skip_rank_by_rank:
            lists = transformer_task_lists(shape, spec, **layout, recipe=plan)
            tasks_text = f"{sum(map(len, lists)):,}"
            del lists
            slow, every = timed(lambda: simulate_plan(shape, spec, plan, symmetric=False), 1)
            slow_text, ratio_text = f"{slow:.2f} s", f"{slow / fast:.0f}x"
            agree = " (equal)" if every.step_seconds == result.step_seconds else f" (rank by rank {every.step_seconds:.4f} s)"
            del every
        description = f"{name}, {plan} on {spec_name.upper()}"
        print(f"{world:>6}  {description:<120} {tasks_text:>14} / {symmetric_tasks:<14,}  {slow_text:>12}  {fast:>7.3f} s  "
              f"{ratio_text:>6}  {result.step_seconds:.3f} s{agree}, bubble {result.bubble_fraction:.1%}", flush=True)
    print(f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
