"""DualPipeV (issue 38; DeepSeek-V3 technical report, arXiv 2412.19437): p ranks, 2p stages in a V, rank r holds r
and 2p - 1 - r; overlapped forward/backward pairs emitted forward then backward, a full backward as B then W.

Units as tests/unit/schedules/test_v_shape.py: ``bubble_fraction`` with F = B = W = 1, activations by
``peak_in_flight`` in 1F1B-stage units (a V stage is half a 1F1B stage).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from lightning_nnscaler.schedules import Schedule, ScheduleError, bubble_fraction, dual_pipe_v, lower, peak_in_flight, validate, zbv
from lightning_nnscaler.schedules.dual_pipe import _rank_program

CASES = [(2, 4), (2, 5), (2, 8), (2, 12), (4, 8), (4, 9), (4, 16)]


def test_two_ranks_run_dualpipev_order() -> None:
    # rank 0: 2 chunk-0 forwards; F0 F1; B1 F1; the steady "F0 B1 F1 B0"; B1 F1 B0; B1 B0 (W deferred); W B0 (W deferred); W
    assert dual_pipe_v(2, 4).as_text() == [
        ["0F0", "0F1", "0F2", "3F0", "3B0", "3W0", "3F1", "0F3", "3B1", "3W1", "3F2", "0B0", "0W0",
         "3B2", "3W2", "3F3", "0B1", "0W1", "3B3", "3W3", "0B2", "0W2", "0B3", "0W3"],
        ["1F0", "2F0", "1F1", "2F1", "1F2", "2B0", "2W0", "2F2", "1B0", "1W0", "1F3", "2B1", "2W1",
         "2F3", "1B1", "1W1", "2B2", "2W2", "1B2", "1W2", "2B3", "1B3", "2W3", "1W3"],
    ]
    assert dual_pipe_v(2, 4).stage_ranks == (0, 1, 1, 0)


@pytest.mark.parametrize(("ranks", "microbatches"), CASES)
def test_dualpipev_places_the_v_runs_every_action_once_and_validates(ranks: int, microbatches: int) -> None:
    schedule = dual_pipe_v(ranks, microbatches)
    assert schedule.stage_ranks == tuple(min(stage, 2 * ranks - 1 - stage) for stage in range(2 * ranks))
    validate(lower(schedule))  # no deadlock, no crossed messages
    for rank, rank_actions in enumerate(schedule.actions):
        expected = {(stage, microbatch, kind) for stage in (rank, 2 * ranks - 1 - rank) for microbatch in range(microbatches) for kind in "FBW"}
        assert sorted((action.stage, action.microbatch, action.kind.value) for action in rank_actions) == sorted(expected)


def torch_order(ranks: int, microbatches: int) -> list[list[str]]:
    """torch's ScheduleDualPipeV per-rank order in our text: an overlapped pair as its two actions, a full backward
    as B then W, torch's I (input gradients) as B."""
    owner = SimpleNamespace(pp_group_size=ranks, _n_microbatches=microbatches)
    texts = {torch_schedules.FORWARD: ["F"], torch_schedules.FULL_BACKWARD: ["B", "W"],
             torch_schedules.BACKWARD_INPUT: ["B"], torch_schedules.BACKWARD_WEIGHT: ["W"]}
    order = []
    for rank in range(ranks):
        actions = torch_schedules.ScheduleDualPipeV._calculate_single_rank_operations(owner, rank)
        parts = [part for action in actions for part in (action.sub_actions or (action,))]
        order.append([f"{part.stage_index}{kind}{part.microbatch_index}" for part in parts for kind in texts[part.computation_type]])
    return order


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
def test_the_order_is_torch_dualpipev_with_chunk_0_forwards_moved_later(ranks: int) -> None:
    for microbatches in (2 * ranks, 2 * ranks + 3):
        ours, reference = dual_pipe_v(ranks, microbatches).as_text(), torch_order(ranks, microbatches)
        for rank in range(ranks):
            first_chunk_forward = f"{rank}F"
            assert [text for text in ours[rank] if not text.startswith(first_chunk_forward)] == \
                   [text for text in reference[rank] if not text.startswith(first_chunk_forward)]
            moved = [ours[rank].index(text) - reference[rank].index(text) for text in ours[rank] if text.startswith(first_chunk_forward)]
            assert min(moved) >= 0  # later, never earlier
        if ranks <= 2:
            assert ours == reference  # nothing to move: the last rank's order sets the only channel's
    assert dual_pipe_v(4, 8).as_text() != torch_order(4, 8)


def test_the_unmoved_order_crosses_messages_and_is_refused_with_the_grid() -> None:
    """At p = 3, rank 0 computes 0F4 before 5B0 but rank 1 takes 4's gradient of microbatch 0 before 1's input 4:
    sent right after they are computed, the two messages arrive crossed; ``dual_pipe_v`` moves 0F4 after 5B0."""
    unmoved = Schedule([_rank_program(rank, 3, 6) for rank in range(3)], dual_pipe_v(3, 6).stage_ranks, 6)
    with pytest.raises(ScheduleError) as caught:
        validate(lower(unmoved))
    message = str(caught.value)
    assert "crossed send/recv order from rank 0 to rank 1: message 4 is 0SEND_F4->1 on rank 0, but rank 1 receives it as 4RECV_B0<-0" in message
    assert "step | rank 0" in message and "*0SEND_F4->1*" in message and "*4RECV_B0<-0*" in message
    assert dual_pipe_v(3, 6).as_text()[0][4:7] == ["5F0", "5B0", "0F4"]


def test_measured_bubbles_and_peaks() -> None:
    measured = {(p, m): (round(bubble_fraction(dual_pipe_v(p, m)), 3), max(peak_in_flight(dual_pipe_v(p, m))) / 2)
                for p, m in ((2, 4), (2, 8), (4, 8), (4, 16), (8, 16))}
    assert measured == {(2, 4): (0.04, 2.5), (2, 8): (0.02, 2.5), (4, 8): (0.059, 4.5), (4, 16): (0.03, 4.5), (8, 16): (0.068, 8.5)}
    # ZB-V: (0.077, 2), (0.04, 2), (0.059, 4), (0.03, 4), (0.086, 8); 1F1B: (0.2, 2), (0.111, 2), (0.273, 4), (0.158, 4), (0.304, 8)
    assert round(bubble_fraction(zbv(8, 16)), 3) == 0.086 and max(peak_in_flight(zbv(8, 16))) / 2 == 8.0


@pytest.mark.parametrize(
    ("ranks", "microbatches", "message"),
    [
        (2, 3, r"dualpipev: microbatches must be an integer >= 2 × ranks = 4 \(one per stage\), got 3"),
        (4, 7, r"dualpipev: microbatches must be an integer >= 2 × ranks = 8 \(one per stage\), got 7"),
        (2, True, r"dualpipev: microbatches must be an integer >= 2 × ranks = 4 \(one per stage\), got True"),
        (0, 4, r"dualpipev: ranks must be a positive integer, got 0"),
        (2.0, 4, r"dualpipev: ranks must be a positive integer, got 2.0"),
    ],
)
def test_too_few_microbatches_or_bad_ranks_are_refused_naming_the_parameter(ranks, microbatches, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dual_pipe_v(ranks, microbatches)
