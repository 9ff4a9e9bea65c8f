"""GPipe (Huang et al. 2019): every rank runs all forwards, then all backwards.

Rank r holds stage r. Peak in-flight microbatches per rank: m (all of them are stashed before the
first backward). Bubble fraction (p - 1) / (m + p - 1).
"""

from __future__ import annotations

from lightning_nnscaler.schedules.actions import B, F, Action, Schedule, require_positive


def gpipe(stages: int, microbatches: int) -> Schedule:
    """Compute-only GPipe schedule: rank r runs ``rF0 … rF(m-1)`` then ``rB0 … rB(m-1)``.

    Backwards run in microbatch order, as torch.distributed.pipelining's ``ScheduleGPipe`` does.
    """
    require_positive(stages=stages, microbatches=microbatches)
    actions = [
        [Action(stage, microbatch, F) for microbatch in range(microbatches)]
        + [Action(stage, microbatch, B) for microbatch in range(microbatches)]
        for stage in range(stages)
    ]
    return Schedule(actions, tuple(range(stages)), microbatches)
