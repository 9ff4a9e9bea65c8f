"""Validation rejects bad hand-written schedules before any process starts, with the marked step × rank grid."""

from __future__ import annotations

import pytest

from lightning_nnscaler.schedules import Schedule, ScheduleError, grid, lower, one_f_one_b, validate


def rejection(actions: list[list[str]], stage_ranks: list[int], microbatches: int) -> str:
    with pytest.raises(ScheduleError) as error:
        validate(Schedule.from_text(actions, stage_ranks, microbatches))
    return str(error.value)


def test_crossed_send_recv_order_is_rejected_with_the_grid() -> None:
    # Rank 1 receives microbatch 1 first, but rank 0 sends microbatch 0 first: gloo/NCCL would pair them.
    message = rejection(
        [
            ["0F0", "0SEND_F0->1", "0F1", "0SEND_F1->1", "0RECV_B0<-1", "0B0", "0RECV_B1<-1", "0B1"],
            ["1RECV_F1<-0", "1F1", "1RECV_F0<-0", "1F0", "1B0", "1SEND_B0->0", "1B1", "1SEND_B1->0"],
        ],
        [0, 1],
        2,
    )
    assert message.startswith(
        "crossed send/recv order from rank 0 to rank 1: message 0 is 0SEND_F0->1 on rank 0, "
        "but rank 1 receives it as 1RECV_F1<-0; both ranks must send and receive in the same order\n"
    )
    assert "step | rank 0        | rank 1\n" in message
    assert "0    | 0F0           | *1RECV_F1<-0*\n1    | *0SEND_F0->1* | 1F1\n" in message


def test_backward_before_its_forward_is_rejected_with_the_grid() -> None:
    message = rejection([["0F0", "0B0"], ["1B0", "1F0"]], [0, 1], 1)
    assert message == (
        "deadlock: rank 0 is stuck at 0B0 (step 1), waiting for 1B0, on rank 1, itself stuck at 1B0\n"
        "rank 1 is stuck at 1B0 (step 0), waiting for 1F0, which rank 1 runs later in its own list (a backward before its forward)\n"
        "step | rank 0 | rank 1\n"
        "---- | ------ | ------\n"
        "0    | 0F0    | *1B0*\n"
        "1    | *0B0*  | 1F0"
    )


def test_cross_rank_cycle_of_receives_is_rejected_with_the_grid() -> None:
    # Rank 0 waits for a gradient before sending the activation that rank 1 needs to produce it.
    message = rejection(
        [["0F0", "0RECV_B0<-1", "0SEND_F0->1", "0B0"], ["1RECV_F0<-0", "1F0", "1B0", "1SEND_B0->0"]], [0, 1], 1
    )
    assert "cross-rank cycle: rank 0 -> rank 1 -> rank 0\n" in message
    assert "rank 1 is stuck at 1RECV_F0<-0 (step 0), waiting for message 0 from rank 0 to rank 1" in message
    assert "0    | 0F0           | *1RECV_F0<-0*\n1    | *0RECV_B0<-1* | 1F0\n" in message


def test_cross_rank_cycle_of_compute_is_rejected_with_the_grid() -> None:
    # Interleaved placement: rank 0 runs stage 2 before stage 0, whose output stage 1 (rank 1) needs first.
    message = rejection([["2F0", "0F0", "2B0", "0B0"], ["1F0", "3F0", "3B0", "1B0"]], [0, 1, 0, 1], 1)
    assert "rank 0 is stuck at 2F0 (step 0), waiting for 1F0, on rank 1, itself stuck at 1F0\n" in message
    assert "cross-rank cycle: rank 0 -> rank 1 -> rank 0\n" in message
    assert "0    | *2F0*  | *1F0*\n" in message


def test_repeated_and_missing_actions_are_rejected() -> None:
    message = rejection([["0F0", "0F0", "0B0"], ["1F0"]], [0, 1], 1)
    assert message.startswith("rank 0: unexpected or repeated actions [0F0]; rank 1: missing actions [1B0]\n")
    assert "0    | *0F0*  | 1F0\n1    | *0F0*  |\n" in message


def test_weight_gradients_must_cover_every_backward_once_split() -> None:
    message = rejection([["0F0", "0B0", "0W0"], ["1F0", "1B0"]], [0, 1], 1)
    assert message.startswith("rank 1: missing actions [1W0]\n")


@pytest.mark.parametrize(
    ("actions", "problem"),
    [
        ([["0F0", "1F0", "0B0"], ["1B0"]], "rank 0 step 1: 1F0 runs on rank 0, but stage 1 is held by rank 1"),
        ([["0F0", "0B0", "0F1"], ["1F0", "1B0"]], "rank 0 step 2: 0F1 names microbatch 1, but the schedule has 1 microbatches"),
        ([["0F0", "0B0", "2F0"], ["1F0", "1B0"]], "rank 0 step 2: 2F0 names stage 2, but the schedule has 2 stages"),
        ([["0F0", "0SEND_F0->5", "0B0"], ["1F0", "1B0"]], "rank 0 step 1: 0SEND_F0->5 names peer rank 5, but the schedule has 2 ranks"),
    ],
)
def test_misplaced_actions_are_rejected(actions: list[list[str]], problem: str) -> None:
    assert rejection(actions, [0, 1], 1).startswith(problem + "\n")


def test_validate_returns_the_timeline_the_grid_renders() -> None:
    schedule = one_f_one_b(2, 2)
    timeline = validate(schedule)
    assert timeline.starts == ((0.0, 1.0, 3.0, 5.0), (1.0, 2.0, 3.0, 4.0))  # 0B1 waits for 1B1
    assert timeline.makespan == 6.0
    assert grid(schedule, timeline) == (
        "step | rank 0 | rank 1\n"
        "---- | ------ | ------\n"
        "0    | 0F0    |\n"
        "1    | 0F1    | 1F0\n"
        "2    |        | 1B0\n"
        "3    | 0B0    | 1F1\n"
        "4    |        | 1B1\n"
        "5    | 0B1    |"
    )


def test_grid_without_timeline_uses_list_positions() -> None:
    assert grid(one_f_one_b(2, 1), mark={(1, 1)}).splitlines()[2:] == ["0    | 0F0    | 1F0", "1    | 0B0    | *1B0*"]


def test_lowered_validation_checks_receives_before_their_consumers() -> None:
    text = lower(one_f_one_b(2, 1)).as_text()
    text[1] = ["1F0", "1RECV_F0<-0", "1B0", "1SEND_B0->0"]
    message = rejection(text, [0, 1], 1)
    assert "waiting for 1RECV_F0<-0, which rank 1 runs later in its own list (a receive after the action that needs it)" in message


def test_activations_and_gradients_between_two_ranks_pair_in_one_order() -> None:
    # Interleaved placement: rank 1 sends 1F1's activation before 3B0's gradient to rank 0, which receives the
    # gradient first (it runs 2B0 before 2F1). Activations alone and gradients alone are in order, but NCCL pairs
    # the p2p operations between two ranks in posting order whatever they carry: the activation would land as 2B0's grad.
    compute_only = Schedule.from_text(
        [["0F0", "0F1", "2F0", "2B0", "2F1", "2B1", "0B0", "0B1"], ["1F0", "1F1", "3F0", "3B0", "3F1", "3B1", "1B0", "1B1"]],
        [0, 1, 0, 1],
        2,
    )
    validate(compute_only)
    with pytest.raises(ScheduleError, match="crossed send/recv order from rank 1 to rank 0: message 1 is 1SEND_F1->0 on rank 1, "
                                            "but rank 0 receives it as 2RECV_B0<-1"):
        validate(lower(compute_only))
