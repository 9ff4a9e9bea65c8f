"""The interlaced schedule: shared stages in every rank's list, run like collectives, validated before any process starts."""

from __future__ import annotations

import pytest

from lightning_nnscaler.schedules import SHARED, Kind, Schedule, ScheduleError, bubble_fraction, interlaced, lower, validate


@pytest.mark.parametrize(("ranks", "microbatches"), [(1, 2), (2, 4), (4, 8), (3, 5), (4, 2)])
def test_interlaced_is_valid_and_every_rank_runs_each_shared_action_once(ranks: int, microbatches: int) -> None:
    schedule = interlaced(ranks, microbatches)
    assert schedule.stage_ranks == (SHARED, *range(ranks), SHARED)
    validate(schedule)
    validate(lower(schedule))
    shared = [action for action in schedule.actions[0] if schedule.is_shared(action.stage)]
    assert len(shared) == 2 * 2 * microbatches  # input and output stage, F and B, per microbatch
    for rank_actions in schedule.actions:
        assert [action for action in rank_actions if schedule.is_shared(action.stage)] == shared  # one global order


def test_shared_stages_meet_the_pipeline_in_memory() -> None:
    """No message crosses a shared stage's boundary (its parts meet by collectives inside the stage)."""
    lowered = lower(interlaced(2, 4))
    messages = [action for rank_actions in lowered.actions for action in rank_actions if not action.kind.is_compute]
    assert {(action.stage, action.kind) for action in messages} == {(1, Kind.SEND_F), (2, Kind.RECV_F), (2, Kind.SEND_B), (1, Kind.RECV_B)}


def test_no_rank_idles_while_the_shared_stages_run() -> None:
    """Shared actions run on every rank at once: the bubble is that of the 1F1B core, not longer."""
    schedule = interlaced(4, 8)
    timeline = validate(schedule)
    for index, action in enumerate(schedule.actions[0]):
        if schedule.is_shared(action.stage):
            starts = {timeline.starts[rank][schedule.actions[rank].index(action)] for rank in range(4)}
            assert len(starts) == 1, f"{action} starts at {starts} on the four ranks"
    assert bubble_fraction(lower(schedule)) < 0.3


def test_shared_actions_interlaced_in_another_order_on_two_ranks_are_rejected_with_the_grid() -> None:
    text = interlaced(2, 2).as_text()
    first, second = text[1].index("0F0"), text[1].index("0F1")
    text[1][first], text[1][second] = text[1][second], text[1][first]  # rank 1 looks up microbatch 1 first
    with pytest.raises(ScheduleError) as error:
        validate(Schedule.from_text(text, [SHARED, 0, 1, SHARED], 2))
    message = str(error.value)
    assert message.startswith("deadlock: rank 0 is stuck at 0F0 (step 0), waiting for every rank to reach 0F0 (a shared stage: all ranks run it together); rank 1 has not")
    assert "cross-rank cycle: rank 0 -> rank 1 -> rank 0" in message
    assert "step | rank 0" in message and "*0F0*" in message and "*0F1*" in message


def test_a_shared_action_missing_on_one_rank_is_rejected() -> None:
    text = interlaced(2, 2).as_text()
    text[0].remove("3B1")
    with pytest.raises(ScheduleError, match=r"rank 0: missing actions \[3B1\]"):
        validate(Schedule.from_text(text, [SHARED, 0, 1, SHARED], 2))
