"""ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §3.1 and Figure 3).

Backward is split into B (input gradients, on the critical path between ranks) and W (weight
gradients, local). ZB-H1 keeps 1F1B's forwards and B's and defers W: rank r delays each W by r
microbatches and runs the deferred W's at the end, where 1F1B leaves the rank idle. Rank r then
holds at most ``(p - 1 - r) + 1 + r = p`` stashed microbatches — 1F1B's peak (rank 0's) — and the
bubble shrinks from (p - 1)(F + B + W) to (p - 1)(F + B - W) in the paper's notation.
"""

from __future__ import annotations

from lightning_nnscaler.schedules.actions import B, F, W, Action, Schedule, require_positive


def zb1(stages: int, microbatches: int) -> Schedule:
    """Compute-only ZB-H1 schedule: 1F1B order with each rank-r W trailing its B by r microbatches."""
    require_positive(stages=stages, microbatches=microbatches)
    actions = []
    for stage in range(stages):
        warmup = min(stages - 1 - stage, microbatches)
        rank_actions = [Action(stage, microbatch, F) for microbatch in range(warmup)]
        for microbatch in range(microbatches):
            if warmup + microbatch < microbatches:
                rank_actions.append(Action(stage, warmup + microbatch, F))
            rank_actions.append(Action(stage, microbatch, B))
            if microbatch >= stage:  # W of the microbatch `stage` places back; the rest wait for the end
                rank_actions.append(Action(stage, microbatch - stage, W))
        first_deferred = max(microbatches - stage, 0)
        rank_actions += [Action(stage, microbatch, W) for microbatch in range(first_deferred, microbatches)]
        actions.append(rank_actions)
    return Schedule(actions, tuple(range(stages)), microbatches)
