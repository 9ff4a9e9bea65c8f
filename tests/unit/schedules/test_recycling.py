"""3F1B: interleaved 1F1B over the recycling passes with their backwards left out."""

from __future__ import annotations

import pytest

from lightning_nnscaler.schedules import ScheduleError, Schedule, lower, peak_in_flight, three_f_one_b, validate


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
