"""Pipeline stage cuts priced by estimate and by measured op times: how even the stages come out.

For each model and stage count, the stages are cut twice (``plans.stage_cuts.cut_stages``): by the estimate from
shapes (``balance="estimate"``) and by each op's forward and backward time measured alone on this CPU (one
thread; ``balance="measured"``, ``sim.profile.measured_prices``). Both cuts are then priced by the measured times of
the ops they cut (those on the batch's path; the prologue and the weights-only views are left out): each stage's
seconds, and the slowest stage over the mean (1.0 is an even cut; the slowest stage sets a
pipeline's pace). The last column is the least that ratio can be with cuts at the places the balancer may use
(where at most 1.25 times the fewest bytes inside the model cross: between blocks and around each residual add),
found by a minimax search over those places: what no balancer of whole sub-layers can beat.

Models: the GPT of ``benchmarks/pipeline.py`` (hidden 256, 8 layers, vocab 512, 2 rows of 64 tokens per
microbatch) and a GPT-2 124M shape (hidden 768, 12 layers, vocab 50257, 2 rows of 128 tokens).

Run: python benchmarks/stage_balance.py
"""

from __future__ import annotations

import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.plans.stage_cuts import _crossing_bytes, cut_stages, op_kinds
from lightning_nnscaler.sim.profile import measured_prices

MODELS = {
    "pipeline.py GPT": (GPTConfig(vocab_size=512, seq_len=64, hidden=256, layers=8, heads=4), 2, (2, 4, 8)),
    "GPT-2 124M shape": (GPTConfig(vocab_size=50257, seq_len=128, hidden=768, layers=12, heads=12), 2, (2, 4)),
}


def least_slowest_stage(costs: list[float], crossing: list[int], stages: int) -> float:
    """The least possible slowest stage, cutting only where at most 1.25× the fewest bytes inside the model cross."""
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    total = prefix[-1]
    inner = [crossing[index] for index in range(1, len(costs)) if 0.1 * total <= prefix[index] <= 0.9 * total]
    places = [0] + [index for index in range(1, len(costs)) if crossing[index] <= 1.25 * min(inner)] + [len(costs)]
    best = {0: 0.0}  # place index -> least slowest stage of the stages so far ending there
    for _ in range(stages):
        best = {end: min((max(slowest, prefix[places[end]] - prefix[places[start]]) for start, slowest in best.items() if start < end),
                         default=float("inf")) for end in range(1, len(places))}
    return best[len(places) - 1]


def main() -> None:
    torch.set_num_threads(1)
    price = measured_prices("cpu")
    print(f"torch {torch.__version__}, 1 thread; stage seconds priced by op times measured alone here (ms)")
    print(f"{'model':18} {'stages':>6} {'cut by':9} {'ms per stage':40} {'slowest/mean':>12} {'least possible':>14}")
    for name, (config, rows, stage_counts) in MODELS.items():
        torch.manual_seed(0)
        model = GPT(config)
        graph = lnn.trace(model, model.example_batch(rows, torch.Generator().manual_seed(0)), step="training_step")
        ops = list(graph.ops)
        kind = op_kinds(graph, ops, {output.name: op for op in ops for output in op.outputs})
        flowing = [op for op in ops if kind[op.name] == "batch"]
        flowing_costs = price(flowing)
        for stages in stage_counts:
            bound = least_slowest_stage(flowing_costs, _crossing_bytes(flowing), stages)
            for balance, prices in (("estimate", None), ("measured", price)):
                stage_of = cut_stages(graph, stages, prices=prices).stage_of
                seconds = [0.0] * stages
                for op, cost in zip(flowing, flowing_costs, strict=True):
                    seconds[stage_of[op.name]] += cost
                mean = sum(seconds) / stages
                row = " ".join(f"{1e3 * value:.1f}" for value in seconds)
                least = bound / (sum(flowing_costs) / stages)
                print(f"{name:18} {stages:>6} {balance:9} {row:40} {max(seconds) / mean:>12.3f} {least:>14.3f}")


if __name__ == "__main__":
    main()
