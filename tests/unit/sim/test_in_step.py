"""``sim.in_step``: communication timed inside steps, matched across ranks and fitted."""

from __future__ import annotations

import pytest

from lightning_nnscaler.runtime.logged_comm import Event
from lightning_nnscaler.sim.in_step import fit_in_step, in_step_durations, late_receive_seconds


def test_a_collective_lasts_from_its_last_arrival_to_its_return() -> None:
    rank0 = [Event("all_reduce", (0, 1), 1000, issued=1.0, returned=1.5)]
    rank1 = [Event("all_reduce", (0, 1), 1000, issued=1.2, returned=1.5)]
    assert in_step_durations([rank0, rank1]) == {("all_reduce", 2): [(1000, pytest.approx(0.3))]}


def test_the_kth_collective_of_a_group_is_matched_with_the_kth_on_every_rank() -> None:
    first, second = (0, 1), (0, 1)
    rank0 = [Event("all_reduce", first, 8, 0.0, 0.1), Event("all_reduce", second, 16, 1.0, 1.4)]
    rank1 = [Event("all_reduce", first, 8, 0.05, 0.1), Event("all_reduce", second, 16, 1.3, 1.4)]
    points = sorted(in_step_durations([rank0, rank1])[("all_reduce", 2)])
    assert points == [(8, pytest.approx(0.05)), (16, pytest.approx(0.1))]


def test_an_async_sum_whose_wait_did_not_block_gives_no_sample() -> None:
    """Its end lies somewhere before the wait: unknown, so it is not counted as the wait's return."""
    rank0 = [Event("all_reduce", (0, 1), 64, issued=0.0, returned=2.0, wait_started=2.0 - 1e-6)]
    rank1 = [Event("all_reduce", (0, 1), 64, issued=0.1, returned=2.5, wait_started=2.5 - 1e-6)]
    assert in_step_durations([rank0, rank1]) == {}
    rank1[0].wait_started = 0.2  # this rank waited from 0.2 to 2.5: the sum took until then
    assert in_step_durations([rank0, rank1]) == {("all_reduce", 2): [(64, pytest.approx(2.4))]}


def test_a_message_counts_where_the_receiver_was_already_waiting_and_a_late_receive_apart() -> None:
    """The first receive waited for its message (its one-way time); the second came after the send (its own time)."""
    sender = [Event("send", (0, 1), 256, issued=1.0), Event("send", (0, 1), 256, issued=3.0)]
    receiver = [Event("recv", (0, 1), 256, issued=0.5, returned=1.1), Event("recv", (0, 1), 256, issued=3.5, returned=3.8)]
    assert in_step_durations([sender, receiver]) == {("p2p", 2): [(256, pytest.approx(0.1))], ("late_recv", 2): [(256, pytest.approx(0.3))]}


def test_late_receives_are_priced_by_their_mean_per_world_size_and_fit_no_alpha_beta() -> None:
    samples = {("late_recv", 2): [(8, 0.0001), (8, 0.0001), (64, 0.0031)], ("late_recv", 4): [(8, 0.001)],
               ("p2p", 2): [(8, 0.00002), (64, 0.00003)]}
    assert late_receive_seconds(samples) == {2: pytest.approx(0.0011), 4: pytest.approx(0.001)}
    assert set(fit_in_step(samples)) == {"p2p"}


def test_a_collective_some_member_did_not_reach_is_left_out() -> None:
    rank0 = [Event("all_gather", (0, 1), 32, 0.0, 0.2)]
    assert in_step_durations([rank0, []]) == {}


def test_fits_need_two_sizes_and_use_each_sizes_mean() -> None:
    """A slow call in the tail counts as much as a step pays for it: the fit goes through each size's mean."""
    samples = {
        ("all_reduce", 2): [(1000, 0.002), (1000, 0.002), (1000, 0.005), (3000, 0.004), (3000, 0.004), (3000, 0.004)],
        ("p2p", 2): [(64, 0.001)],
    }
    fits = fit_in_step(samples)
    assert set(fits) == {"all_reduce"}  # one size of messages: the loop's fit stands
    alpha, beta = fits["all_reduce"][2]
    # means 3 ms at 1000 B (the median is 2 ms) and 4 ms at 3000 B; all-reduce moves 2(p-1)/p of the buffer: the same bytes at p = 2
    assert beta == pytest.approx(0.001 / 2000)
    assert alpha == pytest.approx(0.003 - 1000 * beta)


def test_issues_count_as_holds_only_while_the_other_cores_compute() -> None:
    from lightning_nnscaler.sim.in_step import busy_issue_seconds

    # rank 0 sends twice; rank 1 computes at the first send and waits in a receive at the second
    rank0 = [Event("send", (0, 1), 8, issued=1.0, issue_returned=1.003), Event("send", (0, 1), 8, issued=2.0, issue_returned=2.0001)]
    rank1 = [Event("recv", (0, 1), 8, issued=1.5, returned=1.6), Event("recv", (0, 1), 8, issued=1.9, returned=2.1)]
    two_cores = in_step_durations([rank0, rank1], cores=2)
    assert two_cores["issue", 2] == [(8, pytest.approx(0.003))]
    assert busy_issue_seconds(two_cores) == pytest.approx(0.003)
    assert ("issue", 2) not in in_step_durations([rank0, rank1], cores=4)  # cores to spare: never busy
    assert ("issue", 2) not in in_step_durations([rank0, rank1])
    assert busy_issue_seconds({}) == 0.0
    # the message is timed from the send call's return, after its hold
    assert two_cores["p2p", 2] == [(8, pytest.approx(0.0999))]
    assert "issue" not in fit_in_step({**two_cores, ("issue", 2): [(8, 0.001), (16, 0.002)]})


def test_a_size_seen_rarely_weighs_less_in_the_fit() -> None:
    many = [(1000, 0.001)] * 50 + [(3000, 0.002)] * 50
    alpha, beta = fit_in_step({("p2p", 2): [*many, (8, 0.050), (8, 0.040), (8, 0.060)]})["p2p"][2]
    equal_alpha, _ = fit_in_step({("p2p", 2): [(1000, 0.001), (3000, 0.002), (8, 0.050)]})["p2p"][2]
    assert alpha < 0.01 < equal_alpha  # three slow loss messages do not set every message's latency


def test_a_ranks_communication_time_adds_its_calls_and_waits() -> None:
    from lightning_nnscaler.sim.in_step import communication_seconds

    events = [
        Event("send", (0, 1), 8, issued=0.0, issue_returned=0.001),
        Event("recv", (1, 0), 8, issued=0.010, returned=0.013),
        Event("all_reduce", (0, 1), 64, issued=0.020, issue_returned=0.0205, wait_started=0.030, returned=0.032),
        Event("all_reduce", (0, 1), 64, issued=0.040, returned=0.041),
    ]
    assert communication_seconds(events) == pytest.approx(0.001 + 0.003 + 0.0005 + 0.002 + 0.001)


def test_a_receive_posted_where_its_message_was_sent_is_not_a_late_receive() -> None:
    sender = [Event("send", (0, 1), 8, issued=0.0, issue_returned=0.001)]
    posted = [Event("recv", (0, 1), 8, issued=0.010, returned=0.0101, posted=True)]
    assert "late_recv" not in {kind for kind, _ in in_step_durations([sender, posted])}
    asked = [Event("recv", (0, 1), 8, issued=0.010, returned=0.012)]
    assert in_step_durations([sender, asked])[("late_recv", 2)] == [(8, pytest.approx(0.002))]
