"""Communication timed inside training steps: what the simulator's α–β fits are calibrated on.

A microbenchmark times a collective in a loop of its own; a training step meets it after a stretch of
compute, with the other ranks arriving at their own times, and on a machine whose ranks share cores
(gloo over loopback) the two differ by several times, both ways: here one all-reduce of 3.7 MB takes
1.5 ms in a loop and 6 ms (median) in a data-parallel step, while a message the receiver already waits
for arrives in 0.1 ms, not the 0.35 ms of a loop of exchanges.

``runtime.logged_comm.LoggedCommunicator`` records, on every rank, when each operation was issued and when it returned (the
ranks of one machine share its monotonic clock). ``in_step_durations`` matches the ranks' records: a
collective lasts from its last member's arrival (the return of its issuing call) to its first return (an
asynchronous one: the first return among the ranks that blocked in their wait; a wait that came later
returns later than the collective ended); a message, from the
return of its send call to the return of a receive that was already waiting (the one-way time the
simulator prices; a receive that comes later finds the message there or on its way). ``fit_in_step``
fits ``alpha + beta · ring bytes`` per kind and group size over the mean of each size, weighed by its
samples. On shared cores, issuing a send or an asynchronous sum while every other core computes holds
the issuing rank until the communication thread gets a core; ``busy_issue_seconds`` is its mean (the
hold is rare and long: a time slice of the scheduler), which the simulator charges such issues. A
receive posted after its message was sent (a pipeline stage that finished its compute late) does not
find the message there: gloo moves it when the receive asks, once the sender's communication thread
runs; ``late_receive_seconds`` is the mean time of such receives, by world size (a receive the runtime posted where
its message was sent, ``Event.posted``, is not one: the simulator charges it nothing).

Ranks with the same work do not reach a collective at the same moment: ``arrival_spreads`` measures how far
apart they arrive against the compute each ran since it last met the others, and ``fit_jitter`` makes of
them the simulator's clock uncertainty (``sim.jitter``).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import Protocol

from lightning_nnscaler.sim.calibrate import fit_alpha_beta
from lightning_nnscaler.sim.costs import ring_bytes
from lightning_nnscaler.sim.jitter import expected_range

BLOCKED_AT_LEAST = 5e-5
"""An asynchronous collective's wait that returned sooner than this did not block: its end is unknown."""


class CommEvent(Protocol):
    """One communication operation on one rank, as ``runtime.logged_comm.Event`` records it."""

    kind: str
    key: tuple[int, ...]
    nbytes: int
    issued: float
    returned: float | None
    wait_started: float | None
    issue_returned: float | None
    posted: bool

    def windows(self) -> list[tuple[float, float]]:
        """When the rank was in this operation (not computing)."""

    def waiting(self, moment: float) -> bool:
        """Whether the rank was in this operation (not computing) at ``moment``."""


def in_step_durations(
    rank_events: Sequence[Sequence[CommEvent]], cores: int | None = None,
) -> dict[tuple[str, int], list[tuple[int, float]]]:
    """``(kind, group size) -> [(bytes per rank, seconds)]`` from one step's events of every rank (see the module
    docstring); messages are ``("p2p", world size)``. The k-th collective over a group is the same on every rank.

    With ``cores`` (the node's, all ranks on one node), also ``("issue", world size)``: how long issuing a send or
    an asynchronous sum held its rank at moments when the other ranks computing filled the other cores (a rank
    computes wherever it is in no operation).
    """
    samples: dict[tuple[str, int], list[tuple[int, float]]] = defaultdict(list)
    sends: dict[tuple[int, ...], list[CommEvent]] = defaultdict(list)
    receives: dict[tuple[int, ...], list[CommEvent]] = defaultdict(list)
    for events in rank_events:
        for event in events:
            if event.kind == "send":
                sends[event.key].append(event)
            elif event.kind == "recv":
                receives[event.key].append(event)
    for (kind, group, _), members in matched_collectives(rank_events).items():
        if len(members) < len(group):
            continue
        last_arrival = max(event.issue_returned or event.issued for event in members.values())  # after any issue hold
        ends = [event.returned for event in members.values() if event.returned is not None
                and (event.wait_started is None or event.returned - event.wait_started >= BLOCKED_AT_LEAST)]
        if ends:
            samples[kind, len(group)].append((next(iter(members.values())).nbytes, min(ends) - last_arrival))
    if cores is not None:
        for rank, events in enumerate(rank_events):
            for event in events:
                if event.issue_returned is None:
                    continue
                computing = sum(not any(other.waiting(event.issued) for other in rank_events[peer])
                                for peer in range(len(rank_events)) if peer != rank)
                if computing + 1 >= cores:
                    samples["issue", len(rank_events)].append((event.nbytes, event.issue_returned - event.issued))
    for pair, sent in sends.items():
        for send, receive in zip(sent, receives.get(pair, []), strict=False):
            if receive.returned is None:
                continue
            sent_at = send.issue_returned or send.issued
            if receive.issued <= send.issued:  # the receiver was waiting
                samples["p2p", len(rank_events)].append((send.nbytes, receive.returned - sent_at))
            elif receive.issued >= sent_at and not receive.posted:  # sent before its receive was posted
                samples["late_recv", len(rank_events)].append((send.nbytes, receive.returned - receive.issued))
    return dict(samples)


def matched_collectives(rank_events: Sequence[Sequence[CommEvent]]) -> dict[tuple[str, tuple[int, ...], int], dict[int, CommEvent]]:
    """``(kind, group, k) -> {rank: event}``: the k-th collective of a kind over a group is the same on every member."""
    collectives: dict[tuple[str, tuple[int, ...], int], dict[int, CommEvent]] = defaultdict(dict)
    for rank, events in enumerate(rank_events):
        count: dict[tuple[str, tuple[int, ...]], int] = defaultdict(int)
        for event in events:
            if event.kind in ("send", "recv"):
                continue
            number = count[event.kind, event.key]
            count[event.kind, event.key] += 1
            collectives[event.kind, event.key, number][rank] = event
    return collectives


def fit_in_step(samples: dict[tuple[str, int], list[tuple[int, float]]], min_sizes: int = 2) -> dict[str, dict[int, tuple[float, float]]]:
    """``{kind: {group size: (alpha, beta)}}`` over the mean seconds of each size (``sim.costs.ring_bytes``), each
    weighed by its samples (a size seen three times, such as a data-parallel step's loss message, must not pull
    a fit that hundreds of tensor-parallel messages make); a kind and group size seen at fewer than
    ``min_sizes`` sizes is left out (its loop fit stands).

    The mean, not the median: in-step costs are heavy-tailed (co-shard's 256 KiB all-reduces: median 0.54 ms,
    mean 1.5 ms, a few calls waiting a scheduler slice), and a step adds up all its calls, so its time follows
    their mean. From the same calibration samples, the accuracy benchmark's 16 plans scored 16.5-16.8 % mean
    error (Kendall tau 0.70-0.76) on two measurements with median fits, 11.6-13.1 % (tau 0.77-0.80) with means."""
    fits: dict[str, dict[int, tuple[float, float]]] = {}
    for (kind, ranks), points in samples.items():
        if kind in ("issue", "late_recv"):
            continue
        by_size: dict[int, list[float]] = defaultdict(list)
        for nbytes, seconds in points:
            by_size[nbytes].append(seconds)
        if len(by_size) < min_sizes:
            continue
        sizes = sorted(by_size)
        moved = [ring_bytes(kind, ranks, nbytes) for nbytes in sizes]
        means = [statistics.fmean(by_size[nbytes]) for nbytes in sizes]
        fits.setdefault(kind, {})[ranks] = fit_alpha_beta(moved, means, [len(by_size[nbytes]) for nbytes in sizes])
    return fits


def busy_issue_seconds(samples: dict[tuple[str, int], list[tuple[int, float]]]) -> float:
    """The mean hold of an issue while every other core computed (``in_step_durations`` with ``cores``), 0 without any."""
    holds = [seconds for (kind, _), points in samples.items() if kind == "issue" for _, seconds in points]
    return statistics.fmean(holds) if holds else 0.0


def late_receive_seconds(samples: dict[tuple[str, int], list[tuple[int, float]]]) -> dict[int, float]:
    """By world size, the mean time of a receive posted after its message was sent (``in_step_durations``):
    the simulator's ``late_receive_s``. The mean, as for issue holds: most take a tenth of a millisecond, a
    few a scheduler time slice, and a step adds them all up."""
    return {ranks: statistics.fmean(seconds for _, seconds in points)
            for (kind, ranks), points in samples.items() if kind == "late_recv" and points}


def arrival_spreads(
    rank_events: Sequence[Sequence[CommEvent]], starts: Sequence[float], ends: Sequence[float],
) -> list[tuple[float, float]]:
    """``[(compute seconds, spread seconds)]`` of one step whose ranks all run the same work (data parallelism,
    ZeRO, tensor parallelism): for each collective (the k-th over a group on every member) and for the step's end,
    how far apart the ranks arrived, as the standard deviation of one rank's arrival (the range over
    ``sim.jitter.expected_range``), against the mean time each ran since it last met the others (``starts``: when
    each left the barrier before the step; then the return of each operation it waited in). Deterministic
    differences between ranks are what the simulator prices; with the same work on every rank, the spread is the
    noise."""
    def last_met(rank: int, moment: float) -> float:
        """When ``rank`` last left a wait (or the barrier) before ``moment``."""
        return max([starts[rank], *(event.returned for event in rank_events[rank] if event.returned is not None and event.returned <= moment)])

    samples = []
    for (_, group, _), members in matched_collectives(rank_events).items():
        if len(members) == len(group) >= 2:
            arrivals = {rank: event.issue_returned or event.issued for rank, event in members.items()}
            spread = (max(arrivals.values()) - min(arrivals.values())) / expected_range(len(arrivals))
            computed = statistics.fmean(arrived - last_met(rank, members[rank].issued) for rank, arrived in arrivals.items())
            samples.append((computed, spread))
    if len(rank_events) >= 2:
        since = [end - last_met(rank, end) for rank, end in enumerate(ends)]
        samples.append((statistics.fmean(since), (max(ends) - min(ends)) / expected_range(len(ends))))
    return samples


def fit_jitter(samples: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``(seconds, share)``: a rank's clock spread ``seconds + share × compute`` fitted to ``arrival_spreads``
    samples by least squares (the simulator's ``HardwareSpec.jitter_s``)."""
    return fit_alpha_beta([computed for computed, _ in samples], [spread for _, spread in samples])


def communication_seconds(events: Sequence[CommEvent]) -> float:
    """Seconds one rank spent in its operations (a rank calls them one after another): receives and blocking
    collectives whole, sends and asynchronous sums while issuing and waiting."""
    return sum(end - start for event in events for start, end in event.windows())
