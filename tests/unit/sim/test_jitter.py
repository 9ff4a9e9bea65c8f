"""``sim.jitter``: the expected latest of noisy arrivals, and the event engine that waits for it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lightning_nnscaler.runtime.logged_comm import Event
from lightning_nnscaler.sim.in_step import arrival_spreads, fit_jitter
from lightning_nnscaler.sim.jitter import chance_first, expected_range, later_of, latest
from lightning_nnscaler.sim.simulate import Machine, simulate
from lightning_nnscaler.sim.specs import load_spec, spec_from_dict
from lightning_nnscaler.sim.tasks import Collective, Compute, Recv, Send



class Fixed:
    """Messages arrive at once; every collective takes ``collective`` seconds."""

    def __init__(self, collective: float = 1.0) -> None:
        self.collective = collective

    def p2p_seconds(self, src: int, dst: int, nbytes: int) -> tuple[float, float]:
        return 0.0, 0.0

    def collective_seconds(self, kind: str, group: tuple[int, ...], nbytes: int) -> float:
        return self.collective

SHARED = Machine(ranks_per_node=8, cores_per_node=8)
"""Shared cores (the event engine), but as many as ranks: nothing slows down by sharing."""


def test_the_later_of_two_like_arrivals_is_later_by_the_textbook_amount() -> None:
    """max of two standard normals: mean 1/sqrt(pi), variance 1 - 1/pi."""
    mean, std = later_of((0.0, 1.0), (0.0, 1.0))
    assert mean == pytest.approx(1 / math.sqrt(math.pi))
    assert std == pytest.approx(math.sqrt(1 - 1 / math.pi))


def test_the_later_of_two_unlike_arrivals_agrees_with_sampling() -> None:
    rng = np.random.default_rng(0)
    a, b = rng.normal(1.0, 0.5, 400_000), rng.normal(1.4, 1.2, 400_000)
    mean, std = later_of((1.0, 0.5), (1.4, 1.2))
    assert mean == pytest.approx(np.maximum(a, b).mean(), rel=5e-3)
    assert std == pytest.approx(np.maximum(a, b).std(), rel=5e-3)
    assert chance_first((1.0, 0.5), (1.4, 1.2)) == pytest.approx((a < b).mean(), abs=3e-3)


def test_without_noise_or_far_apart_the_latest_is_the_plain_maximum() -> None:
    assert later_of((2.0, 0.0), (3.0, 0.0)) == (3.0, 0.0)
    assert latest([(0.0, 0.01), (5.0, 0.01), (1.0, 0.01)])[0] == pytest.approx(5.0)


def test_the_expected_range_of_normal_samples() -> None:
    assert expected_range(2) == pytest.approx(2 / math.sqrt(math.pi), rel=1e-4)
    assert expected_range(4) == pytest.approx(2.0588, rel=1e-3)
    assert expected_range(1) == 0.0


def test_ranks_with_the_same_compute_meet_at_their_expected_latest_arrival() -> None:
    """Two ranks compute 10 s with a 10 % jitter (1 s each) and all-reduce: the collective starts 1/sqrt(pi) x
    sqrt(2) s late; they leave it together, so the step's end adds nothing more."""
    lists = [[Compute(10.0), Collective("all_reduce", (0, 1), 8)] for _ in range(2)]
    quiet = simulate(lists, Fixed(collective=1.0), SHARED)
    noisy = simulate(lists, Fixed(collective=1.0), Machine(8, 8, compute_jitter=0.1))
    assert quiet.step_seconds == pytest.approx(11.0)
    assert noisy.step_seconds == pytest.approx(11.0 + math.sqrt(2) / math.sqrt(2 * math.pi))


def test_leaving_a_wait_spreads_the_ranks_by_the_meeting_jitter() -> None:
    """With only the meeting figure, each meeting (the collective, the step's end) costs the expected latest of two
    arrivals that far apart."""
    lists = [[Compute(1.0), Collective("all_reduce", (0, 1), 8), Compute(1.0)] for _ in range(2)]
    noisy = simulate(lists, Fixed(collective=1.0), Machine(8, 8, meeting_jitter_seconds=0.5))
    excess = math.sqrt(2) * 0.5 / math.sqrt(2 * math.pi)
    assert noisy.step_seconds == pytest.approx(3.0 + 2 * excess)


def test_a_receiver_far_behind_its_message_pays_nothing_for_the_noise() -> None:
    """A pipeline's bubble absorbs the noise: the message was there long before its receive."""
    lists = [[Compute(1.0), Send(1, 8)], [Compute(20.0), Recv(0), Compute(1.0)]]
    quiet = simulate(lists, Fixed(), SHARED)
    noisy = simulate(lists, Fixed(), Machine(8, 8, compute_jitter=0.05))
    assert noisy.step_seconds == pytest.approx(quiet.step_seconds, rel=1e-6)
    assert quiet.step_seconds == pytest.approx(21.0)


def test_with_a_core_per_rank_a_receive_is_not_priced_for_noise() -> None:
    """A message couples its two clocks: the receive returns when the message arrives, as without noise. The
    receiver's spread keeps growing past it (it has not met the others in a collective), and the step ends at the
    expected latest of the sender's end (10 s, 1 s of spread) and the receiver's (11 s, 1.1 s)."""
    lists = [[Compute(10.0), Send(1, 8)], [Compute(10.0), Recv(0), Compute(1.0)]]
    noisy = simulate(lists, Fixed(), Machine(8, 8, compute_jitter=0.1), record=True)
    assert noisy.ranks[1].end == pytest.approx(11.0)
    assert noisy.step_seconds == pytest.approx(latest([(10.0, 1.0), (11.0, 1.1)])[0])


def test_where_ranks_outnumber_cores_a_receiver_that_waits_waits_for_the_senders_noise() -> None:
    """Two ranks on one core: each computes its 10 s in 20 s (2 s of spread each), and the receive returns at their
    expected later end. The step ends at the expected latest of the sender's end and the receiver's (half of its
    spread left: it waited for the sender one time in two)."""
    lists = [[Compute(10.0), Send(1, 8)], [Compute(10.0), Recv(0)]]
    noisy = simulate(lists, Fixed(), Machine(8, 1, compute_jitter=0.1), record=True)
    received = later_of((20.0, 2.0), (20.0, 2.0))[0]
    assert received == pytest.approx(20.0 + 2.0 * math.sqrt(2) / math.sqrt(2 * math.pi))
    assert noisy.ranks[1].end == pytest.approx(received)
    assert noisy.step_seconds == pytest.approx(latest([(20.0, 2.0), (received, 1.0)])[0])


def test_one_device_per_rank_has_no_jitter() -> None:
    """Only ranks that share a node's cores have it (the GPU specs have none)."""
    lists = [[Compute(10.0), Collective("all_reduce", (0, 1), 8)] for _ in range(2)]
    assert simulate(lists, Fixed(collective=1.0), Machine(8, None, compute_jitter=0.1)).step_seconds == pytest.approx(11.0)


def test_arrival_spreads_measure_how_far_apart_ranks_reach_a_collective() -> None:
    """Both ranks left the barrier at 0; they reached the all-reduce at 10 and 11 ms (spread 1 ms, a standard
    deviation of 1 / 1.128) and ended the step 0.5 ms apart, 3 and 3.5 ms after the all-reduce returned."""
    rank0 = [Event("all_reduce", (0, 1), 64, issued=0.010, returned=0.012)]
    rank1 = [Event("all_reduce", (0, 1), 64, issued=0.011, returned=0.012)]
    samples = arrival_spreads([rank0, rank1], starts=[0.0, 0.0], ends=[0.015, 0.0155])
    assert samples == [(pytest.approx(0.0105), pytest.approx(0.001 / expected_range(2))),
                       (pytest.approx(0.00325), pytest.approx(0.0005 / expected_range(2)))]


def test_the_compute_since_the_ranks_last_met_counts_from_their_last_wait() -> None:
    rank0 = [Event("recv", (1, 0), 8, issued=0.001, returned=0.004), Event("all_reduce", (0, 1), 64, issued=0.006, returned=0.007)]
    rank1 = [Event("send", (1, 0), 8, issued=0.002), Event("all_reduce", (0, 1), 64, issued=0.006, returned=0.007)]
    (computed, spread), _ = arrival_spreads([rank0, rank1], starts=[0.0, 0.0], ends=[0.008, 0.008])
    assert computed == pytest.approx((0.002 + 0.006) / 2)
    assert spread == 0.0


def test_the_jitter_fit_recovers_a_fixed_spread_plus_a_share_of_the_compute() -> None:
    samples = [(compute, 0.0004 + 0.16 * compute) for compute in (0.001, 0.003, 0.01, 0.02)]
    seconds, share = fit_jitter(samples)
    assert (seconds, share) == (pytest.approx(0.0004), pytest.approx(0.16))


def test_a_spec_gives_its_jitter_by_world_size() -> None:
    base = {"name": "x", "memory_bytes": 1, "peak_flops": {"float32": 1.0}, "memory_bandwidth": 1.0,
            "links": {"intra_node": {"bandwidth": 1.0, "latency": 0.0}, "inter_node": {"bandwidth": 1.0, "latency": 0.0}}}
    spec = spec_from_dict({**base, "jitter_s": {2: [0.0004, 0.16], 4: [0.0015, 0.2]}})
    assert spec.jitter(2) == (0.0004, 0.16)
    assert spec.jitter(8) == (0.0015, 0.2)
    assert spec_from_dict(base).jitter(2) == (0.0, 0.0)
    assert load_spec("a100").jitter(8) == (0.0, 0.0)
    assert load_spec("cpu").jitter(2)[1] > 0  # the shipped calibration measured it


def test_a_jitter_entry_that_is_not_seconds_and_share_is_refused_by_name() -> None:
    base = {"name": "x", "memory_bytes": 1, "peak_flops": {"float32": 1.0}, "memory_bandwidth": 1.0,
            "links": {"intra_node": {"bandwidth": 1.0, "latency": 0.0}, "inter_node": {"bandwidth": 1.0, "latency": 0.0}}}
    with pytest.raises(ValueError, match=r"jitter_s\[2\] is 0.3; give \[seconds, share\]"):
        spec_from_dict({**base, "jitter_s": {2: 0.3}}, "mine.yaml")
