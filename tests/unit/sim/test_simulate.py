"""The simulator on hand-made task lists: pipeline bubbles, collectives, messages, sharing, memory."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_nnscaler.schedules import Kind, lower, one_f_one_b, theoretical_bubble_fraction
from lightning_nnscaler.sim.simulate import DeadlockError, Machine, simulate
from lightning_nnscaler.sim.specs import load_spec
from lightning_nnscaler.sim.tasks import Collective, Compute, Recv, Send, WaitCollectives


class Fixed:
    """Messages take ``latency`` plus nothing per byte; every collective takes ``collective`` seconds."""

    def __init__(self, latency: float = 0.0, collective: float = 1.0) -> None:
        self.latency, self.collective = latency, collective

    def p2p_seconds(self, src: int, dst: int, nbytes: int) -> tuple[float, float]:
        return self.latency, 0.0

    def collective_seconds(self, kind: str, group: tuple[int, ...], nbytes: int) -> float:
        return self.collective


def pipeline_lists(ranks: int, microbatches: int, forward: float = 1.0, backward: float = 2.0) -> list[list]:
    schedule = lower(one_f_one_b(ranks, microbatches))
    lists = []
    for rank_actions in schedule.actions:
        tasks = []
        for action in rank_actions:
            if action.kind is Kind.FORWARD:
                tasks.append(Compute(forward, "forward", str(action), activation_bytes=10))
            elif action.kind is Kind.BACKWARD:
                tasks.append(Compute(backward, "backward", str(action), activation_bytes=-10))
            elif action.kind.is_send:
                tasks.append(Send(action.peer, 0))
            else:
                tasks.append(Recv(action.peer))
        lists.append(tasks)
    return lists


@pytest.mark.parametrize("ranks, microbatches", [(2, 4), (2, 8), (4, 8)])
def test_1f1b_bubble_is_the_textbook_one(ranks: int, microbatches: int) -> None:
    result = simulate(pipeline_lists(ranks, microbatches), Fixed())
    assert result.step_seconds == pytest.approx(3.0 * (microbatches + ranks - 1))
    assert result.bubble_fraction == pytest.approx(theoretical_bubble_fraction(ranks, microbatches))


def test_1f1b_activation_peak_is_the_in_flight_microbatches() -> None:
    result = simulate(pipeline_lists(4, 8), Fixed())
    assert [rank.peak_activation_bytes for rank in result.ranks] == [40, 30, 20, 10]


def test_a_collective_starts_when_its_last_member_arrives() -> None:
    lists = [[Compute(2.0), Collective("all_reduce", (0, 1), 8)], [Compute(0.5), Collective("all_reduce", (0, 1), 8)]]
    result = simulate(lists, Fixed(collective=1.0), record=True)
    assert result.step_seconds == pytest.approx(3.0)
    assert result.ranks[1].idle == pytest.approx(1.5)
    assert result.ranks[1].communication == pytest.approx(1.0)
    assert [span.kind for span in result.spans[1]] == ["forward", "idle", "communication"]


def test_a_non_blocking_collective_overlaps_compute_until_the_wait() -> None:
    lists = [[Collective("all_reduce", (0, 1), 8, blocking=False), Compute(0.5), WaitCollectives()] for _ in range(2)]
    assert simulate(lists, Fixed(collective=2.0)).step_seconds == pytest.approx(2.0)


def test_receives_pair_with_sends_in_order_and_wait_for_the_latency() -> None:
    lists = [[Compute(1.0), Send(1, 4), Compute(1.0), Send(1, 4)], [Recv(0), Compute(0.1), Recv(0)]]
    result = simulate(lists, Fixed(latency=0.25), record=True)
    assert result.ranks[1].end == pytest.approx(2.25)
    idle = [(span.start, span.end) for span in result.spans[1] if span.kind == "idle"]
    assert idle[0] == (0.0, 1.0)


def test_ranks_sharing_cores_slow_down_only_while_they_overlap() -> None:
    lists = [[Compute(2.0)], [Compute(2.0)], [Compute(1.0)]]
    result = simulate(lists, Fixed(), Machine(ranks_per_node=4, cores_per_node=2))
    # 3 tasks on 2 cores run at 2/3 speed until the short one ends at 1.5 s; then the two left run at full speed
    assert result.ranks[2].end == pytest.approx(1.5)
    assert result.step_seconds == pytest.approx(2.5)


def test_a_receive_that_no_one_sends_is_a_deadlock() -> None:
    with pytest.raises(DeadlockError, match="rank 0 stuck"):
        simulate([[Recv(1)], [Recv(0)]], Fixed())


def test_an_issue_while_the_other_cores_compute_holds_the_sender() -> None:
    """Two ranks on two cores: rank 0 sends while rank 1 computes (held), then once rank 1 waits (not held)."""
    lists = [
        [Compute(0.001), Send(1, 8), Compute(0.010), Send(1, 8)],
        [Compute(0.005), Recv(0), Recv(0)],
    ]
    free = simulate(lists, Fixed(), Machine(ranks_per_node=2, cores_per_node=2))
    held = simulate(lists, Fixed(), Machine(ranks_per_node=2, cores_per_node=2, busy_issue_seconds=0.002))
    assert held.ranks[0].communication == pytest.approx(free.ranks[0].communication + 0.002)
    assert held.step_seconds == pytest.approx(free.step_seconds + 0.002)
    roomy = simulate(lists, Fixed(), Machine(ranks_per_node=2, cores_per_node=4, busy_issue_seconds=0.002))
    assert roomy.step_seconds == pytest.approx(free.step_seconds)


def test_a_receive_posted_after_its_message_was_sent_takes_the_late_receive_time() -> None:
    """Rank 1 computes past both sends: its receives are late and each takes 2 ms (communication). A receive that
    was posted first (rank 0's, waiting for rank 1's reply) only waits for its message."""
    lists = [
        [Send(1, 8), Send(1, 8), Recv(1)],
        [Compute(0.010), Recv(0), Recv(0), Send(0, 8)],
    ]
    machine = Machine(ranks_per_node=2, cores_per_node=2)
    prompt = simulate(lists, Fixed(), machine)
    late = simulate(lists, Fixed(), Machine(ranks_per_node=2, cores_per_node=2, late_receive_seconds=0.002))
    assert prompt.step_seconds == pytest.approx(0.010)
    assert late.step_seconds == pytest.approx(0.014)
    assert late.ranks[1].communication == pytest.approx(0.004)
    assert late.ranks[0].communication == pytest.approx(0.0)  # its receive was posted before the reply was sent


def test_a_receive_the_runtime_posted_where_its_message_was_sent_is_never_late() -> None:
    lists = [
        [Send(1, 8), Send(1, 8), Recv(1)],
        [Compute(0.010), Recv(0, posted=True), Recv(0), Send(0, 8)],
    ]
    late = simulate(lists, Fixed(), Machine(ranks_per_node=2, cores_per_node=2, late_receive_seconds=0.002))
    assert late.step_seconds == pytest.approx(0.012)  # only the receive not posted ahead pays the 2 ms
    assert late.ranks[1].communication == pytest.approx(0.002)


def test_the_late_receive_time_is_the_specs_entry_for_the_world_size() -> None:
    spec = replace(load_spec("cpu"), late_receive_s={2: 0.001, 4: 0.003})
    assert [spec.late_receive_seconds(world) for world in (2, 3, 4, 8)] == [0.001, 0.001, 0.003, 0.003]
    assert load_spec("a100").late_receive_seconds(8) == 0.0
