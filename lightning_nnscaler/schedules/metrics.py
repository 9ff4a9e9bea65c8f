"""What a schedule costs: bubble fraction from a symbolic execution, the textbook formula, peak stash.

Duration model (``Durations``): F, B and W have fixed costs per stage, communication is free by
default. A B in a schedule without W actions is the whole backward and costs ``backward_input +
backward_weight`` — the defaults 1, 1, 1 give the usual B = 2F, and make 1F1B and ZB-H1 do the same
work, so their bubbles compare fairly.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_nnscaler.schedules.actions import Action, Kind, Schedule
from lightning_nnscaler.schedules.validate import check_structure, execute

SPLIT_SHARE = 0.5
"""B's share of its segment's whole backward time when the schedule splits W off (the input-gradient half)."""
WEIGHT_SHARE = 0.65
"""W's share: the two halves run each backward op once between them (``runtime.split_backward``), but the
split's bookkeeping made F + B + W cost 1.09–1.16× F + B on one CPU rank (``tests/unit/runtime/test_split_backward.py``,
measured in the session that built it); with F about half a backward, W = 1.15 − 0.5 of a backward. The simulator
prices a split backward by these shares, and the V schedules order their actions by them (``plans.pipeline.stage_cost``)."""


@dataclass(frozen=True, kw_only=True)
class Durations:
    """Cost of each action kind, in any time unit.

    Attributes:
        forward: one F.
        backward_input: one B of a split backward (input gradients only).
        backward_weight: one W; a B with no W in the schedule costs ``backward_input + backward_weight``.
        communication: one SEND or RECV (0: overlapped, as the bubble formulas assume).
    """

    forward: float = 1.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    communication: float = 0.0

    def of(self, action: Action, splits_backward: bool) -> float:
        """The duration of ``action`` in a schedule that does (or does not) split backward."""
        if action.kind is Kind.FORWARD:
            return self.forward
        if action.kind is Kind.BACKWARD:
            return self.backward_input if splits_backward else self.backward_input + self.backward_weight
        if action.kind is Kind.WEIGHT:
            return self.backward_weight
        return self.communication


def bubble_fraction(schedule: Schedule, durations: Durations | None = None) -> float:
    """Idle share of the step: ``1 - compute time / (ranks × makespan)``, from an as-soon-as-possible execution.

    Raises:
        ScheduleError: when the schedule is invalid (see ``validate``).
    """
    durations = durations or Durations()
    splits_backward = schedule.splits_backward
    check_structure(schedule)
    timeline = execute(schedule, lambda action: durations.of(action, splits_backward))
    busy = sum(durations.of(action, splits_backward) for rank_actions in schedule.actions for action in rank_actions
               if action.kind.is_compute)
    makespan = timeline.makespan
    return 1.0 - busy / (schedule.world_size * makespan) if makespan else 0.0


def theoretical_bubble_fraction(ranks: int, microbatches: int, virtual_stages: int = 1) -> float:
    """GPipe/1F1B bubble fraction (p - 1) / (m + p - 1) (Narayanan et al. 2021, §2.2).

    With ``virtual_stages`` v > 1 it is interleaved 1F1B's (p - 1) / (v m + p - 1): the bubble shrinks by v.
    """
    return (ranks - 1) / (virtual_stages * microbatches + ranks - 1)


def peak_in_flight(schedule: Schedule) -> list[int]:
    """Per rank, the most microbatch-stages stashed at once: +1 at F, -1 when its last backward half (B or W) runs."""
    release = Kind.WEIGHT if schedule.splits_backward else Kind.BACKWARD
    peaks = []
    for rank_actions in schedule.actions:
        stashed = peak = 0
        for action in rank_actions:
            keeps = action.kind is Kind.FORWARD and schedule.has_backward(action.stage)  # a recycling forward stashes nothing
            stashed += 1 if keeps else -1 if action.kind is release else 0
            peak = max(peak, stashed)
        peaks.append(peak)
    return peaks
