"""3F1B: the recycling passes' forwards, then 1F1B on the gradient pass; and the paper's interleaved order."""

from __future__ import annotations

import pytest

from lightning_nnscaler.schedules import (
    ScheduleError, Schedule, bubble_fraction, interleaved_recycling, lower, peak_in_flight, three_f_one_b, validate,
)


@pytest.mark.parametrize(("ranks", "microbatches", "recycles"), [(2, 2, 3), (2, 4, 3), (4, 8, 3), (4, 4, 2)])
def test_3f1b_is_valid_and_runs_r_forwards_per_backward(ranks: int, microbatches: int, recycles: int) -> None:
    schedule = three_f_one_b(ranks, microbatches, recycles)
    validate(lower(schedule))
    assert schedule.forward_only == (recycles - 1) * ranks
    for rank_actions in schedule.actions:
        forwards = [action for action in rank_actions if action.kind.value == "F"]
        backwards = [action for action in rank_actions if action.kind.value == "B"]
        assert len(forwards) == recycles * len(backwards) == recycles * microbatches
    assert max(peak_in_flight(schedule)) <= microbatches  # only the gradient pass stashes: at most GPipe's m


def test_no_gradient_goes_back_into_a_recycling_stage() -> None:
    lowered = lower(three_f_one_b(2, 2, 3))
    first_gradient_stage = 4
    assert not [action for rank_actions in lowered.actions for action in rank_actions
                if action.kind.value == "SEND_B" and action.stage == first_gradient_stage]


def test_a_backward_of_a_recycling_stage_is_refused() -> None:
    schedule = three_f_one_b(2, 2, 2)
    with_extra = [list(rank_actions) for rank_actions in schedule.as_text()]
    with_extra[0].append("0B0")
    with pytest.raises(ScheduleError, match=r"unexpected or repeated actions \[0B0\]"):
        validate(Schedule.from_text(with_extra, schedule.stage_ranks, 2, schedule.forward_only))


@pytest.mark.parametrize(("ranks", "microbatches", "recycles"), [(4, 8, 3), (8, 16, 3), (4, 4, 2), (3, 6, 3)])
def test_3f1b_ends_at_the_lowest_makespan_with_1f1b_activations(ranks: int, microbatches: int, recycles: int) -> None:
    """With F = 1 and B = 2 no order ends before (p - 1) F + every rank's work + (p - 1) B: the last rank waits for its
    first input, and rank 0 ends after the last rank's last backward has come back. 3F1B reaches it, stashing 1F1B's
    p - r microbatches; the paper's interleaved order does not reach it."""
    work = recycles * microbatches + 2 * microbatches
    lowest = 1 - work / (work + 3 * (ranks - 1))
    schedule = three_f_one_b(ranks, microbatches, recycles)
    assert bubble_fraction(schedule) == pytest.approx(lowest)
    assert peak_in_flight(schedule) == [min(microbatches, ranks - rank) for rank in range(ranks)]
    assert bubble_fraction(interleaved_recycling(ranks, microbatches, recycles)) >= lowest - 1e-12


def test_at_two_ranks_rank_0_receives_every_recycling_output_before_a_gradient() -> None:
    """At p = 2 the last rank sends rank 0 its recycling outputs and its gradients on one channel, all outputs first:
    rank 0 runs its gradient-pass forwards before its backwards, so the messages pair in order."""
    schedule = three_f_one_b(2, 4, 3)
    validate(lower(schedule))
    rank0 = [str(action) for action in schedule.actions[0] if action.stage == 4]
    assert rank0 == ["4F0", "4F1", "4F2", "4F3", "4B0", "4B1", "4B2", "4B3"]
