"""ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §3.1 and Figure 3).

Backward is split into B (input gradients, on the critical path between ranks) and W (weight
gradients, local). ZB-H1 keeps 1F1B's forwards and B's and defers W: rank r delays each W by r
microbatches and runs the deferred W's at the end, where 1F1B leaves the rank idle. Rank r then
holds at most ``(p - 1 - r) + 1 + r = p`` stashed microbatches — 1F1B's peak (rank 0's) — and the
bubble shrinks from (p - 1)(F + B + W) to (p - 1)(F + B - W) in the paper's notation.
"""

from __future__ import annotations

from lightning_nnscaler.schedules.actions import B, W, Action, Schedule
from lightning_nnscaler.schedules.one_f_one_b import one_f_one_b


def zb1(stages: int, microbatches: int) -> Schedule:
    """Compute-only ZB-H1 schedule: 1F1B order with each rank-r W trailing its B by r microbatches."""
    order = one_f_one_b(stages, microbatches)
    actions = []
    for stage, rank_order in enumerate(order.actions):
        rank_actions = []
        for action in rank_order:
            rank_actions.append(action)
            if action.kind is B and action.microbatch >= stage:  # W of the microbatch `stage` places back
                rank_actions.append(Action(stage, action.microbatch - stage, W))
        first_deferred = max(microbatches - stage, 0)  # the rest wait for the end, where 1F1B idles
        rank_actions += [Action(stage, microbatch, W) for microbatch in range(first_deferred, microbatches)]
        actions.append(rank_actions)
    return Schedule(actions, order.stage_ranks, microbatches)
