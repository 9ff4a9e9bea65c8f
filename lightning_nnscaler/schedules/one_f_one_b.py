"""1F1B (PipeDream-Flush, Narayanan et al. 2021): warm-up forwards, then one forward / one backward, then cool-down.

Rank r holds stage r and runs ``p - 1 - r`` warm-up forwards (Megatron's ``num_warmup_microbatches``),
so at most ``p - r`` microbatches are stashed at once; the bubble fraction is the same as GPipe's,
(p - 1) / (m + p - 1). torch.distributed.pipelining's ``Schedule1F1B`` gives the same per-rank order
(it counts the first steady forward as warm-up and then alternates backward/forward).
"""

from __future__ import annotations

from lightning_nnscaler.schedules.actions import B, F, Action, Schedule, require_positive


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """Compute-only 1F1B schedule; for p=2, m=4 rank 0 runs ``0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3``."""
    require_positive(stages=stages, microbatches=microbatches)
    actions = []
    for stage in range(stages):
        warmup = min(stages - 1 - stage, microbatches)
        rank_actions = [Action(stage, microbatch, F) for microbatch in range(warmup)]
        for microbatch in range(microbatches):
            if warmup + microbatch < microbatches:  # steady: the next forward, then the oldest backward
                rank_actions.append(Action(stage, warmup + microbatch, F))
            rank_actions.append(Action(stage, microbatch, B))
        actions.append(rank_actions)
    return Schedule(actions, tuple(range(stages)), microbatches)
