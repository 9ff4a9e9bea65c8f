"""The list-scheduling engine: every rank on a device of its own, each task as soon as its order and peers allow.

Without shared cores a rank's times depend only on its own list and on when its messages arrive and
its collectives end, so no global clock is needed (as ``schedules.validate.execute``): a rank runs
until a receive's message or a collective's last member is missing, then sleeps on that one key; the
send or the arrival that completes the key wakes it. Each task is handled once, plus once per wake.
Streams: a message occupies its sender→receiver channel for its transfer time; a collective waits
for every member's stream of its group (posting order per rank and group is list order, so the
result does not depend on which rank happens to run first).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from lightning_nnscaler.sim.results import CommunicationModel, Machine, RankStats, Span
from lightning_nnscaler.sim.tasks import Collective, Compute, Recv, Send, Task


class ListRun:
    """One list-scheduling run (``simulate`` reads ``cursor``, ``stats`` and ``spans`` after ``go``)."""

    def __init__(self, lists: Sequence[Sequence[Task]], comm: CommunicationModel, machine: Machine, record: bool) -> None:
        self.lists, self.comm, self.record = lists, comm, record
        self.world = len(lists)
        self.cursor = [0] * self.world
        self.clock = [0.0] * self.world
        self.stats = [RankStats() for _ in range(self.world)]
        self.spans: list[list[Span]] = [[] for _ in range(self.world)]
        self.live = [0] * self.world
        self.held = [0] * self.world
        self.sent: dict[tuple[int, int], int] = {}
        self.received: dict[tuple[int, int], int] = {}
        self.messages: dict[tuple[int, int, int], tuple[float, float]] = {}  # (src, dst, k) -> (posted, arrives)
        self.channel_free: dict[tuple[int, int], float] = {}
        self.collective_count: dict[tuple[int, tuple[int, ...]], int] = {}
        self.arrivals: dict[tuple, list] = {}  # key -> [members arrived, latest arrival]
        self.windows: dict[tuple, tuple[float, float]] = {}  # key -> (start, end)
        self.comm_free: dict[tuple[int, tuple[int, ...]], float] = {}
        self.current: list[tuple | None] = [None] * self.world  # the collective key a rank has arrived at
        self.pending: list[list[tuple]] = [[] for _ in range(self.world)]
        self.waiting: dict[tuple, list[int]] = {}
        self.ready: deque[int] = deque(range(self.world))
        self.p2p_cache: dict[tuple[int, int, int], tuple[float, float]] = {}
        self.collective_cache: dict[tuple[str, tuple[int, ...], int], float] = {}

    def go(self) -> None:
        """Advance ranks until none can move."""
        ready = self.ready
        while ready:
            self.advance(ready.popleft())

    def _wake(self, key: tuple) -> None:
        sleepers = self.waiting.pop(key, None)
        if sleepers:
            self.ready.extend(sleepers)

    def advance(self, rank: int) -> None:
        """Run ``rank``'s tasks until one waits for a peer, or the list ends (hot loop: state in locals)."""
        tasks, stats, record = self.lists[rank], self.stats[rank], self.record
        messages, received, windows = self.messages, self.received, self.windows
        index, clock, count = self.cursor[rank], self.clock[rank], len(tasks)
        busy, live, peak = 0.0, self.live[rank], stats.peak_activation_bytes
        peak_live, gradients, at_peak = stats.peak_live_bytes, stats.gradient_bytes, stats.gradients_at_peak
        sent, held = stats.sent_bytes, self.held[rank]
        while index < count:
            task = tasks[index]
            kind = type(task)
            if kind is Compute:
                end = clock + task.seconds
                busy += task.seconds
                if live + gradients + sent + held + task.transient_bytes > peak_live:
                    peak_live, at_peak = live + gradients + sent + held + task.transient_bytes, gradients
                gradients += task.gradient_bytes  # made while the task frees its activations: counted after it
                if task.activation_bytes:
                    live += task.activation_bytes
                    if live > peak:
                        peak = live
                held += task.held_bytes
                if live + gradients + sent + held > peak_live:
                    peak_live, at_peak = live + gradients + sent + held, gradients
                if record:
                    self.spans[rank].append(Span(task.kind, clock, end, task.label))
                clock = end
            elif kind is Send:
                sent += task.nbytes
                self._post(rank, task, clock)
            elif kind is Recv:
                channel = (task.peer, rank)
                number = received.get(channel, 0)
                message = messages.pop((task.peer, rank, number), None)
                if message is None:
                    self.waiting.setdefault((task.peer, rank, number), []).append(rank)
                    break
                received[channel] = number + 1
                sent -= task.releases
                if message[1] > clock:
                    clock = self._wait(rank, clock, message[0], message[1], "recv", task.label)
            elif kind is Collective:
                key = self.current[rank] or self._arrive(rank, task, clock)
                if not task.blocking:
                    self.pending[rank].append(key)
                    self.current[rank] = None
                else:
                    window = windows.get(key)
                    if window is None:
                        self.waiting.setdefault(key, []).append(rank)
                        break
                    self.current[rank] = None
                    if window[1] > clock:
                        clock = self._wait(rank, clock, window[0], window[1], task.kind, task.label)
            else:
                unresolved = next((key for key in self.pending[rank] if key not in windows), None)
                if unresolved is not None:
                    self.waiting.setdefault(unresolved, []).append(rank)
                    break
                spans = [windows[key] for key in self.pending[rank]]
                self.pending[rank] = []
                if spans:
                    clock = self._wait(rank, clock, min(start for start, _ in spans), max(end for _, end in spans), "wait", task.label)
            index += 1
        self.cursor[rank], self.clock[rank], self.live[rank], self.held[rank] = index, clock, live, held
        stats.busy += busy
        stats.peak_activation_bytes, stats.peak_live_bytes, stats.gradient_bytes, stats.gradients_at_peak, stats.sent_bytes = peak, peak_live, gradients, at_peak, sent
        if index == count:
            stats.end = clock

    def _post(self, rank: int, task: Send, clock: float) -> None:
        channel = (rank, task.peer)
        number = self.sent.get(channel, 0)
        self.sent[channel] = number + 1
        cost_key = (rank, task.peer, task.nbytes)
        cost = self.p2p_cache.get(cost_key)
        if cost is None:
            cost = self.p2p_cache[cost_key] = self.comm.p2p_seconds(rank, task.peer, task.nbytes)
        latency, transfer = cost
        start = max(clock, self.channel_free.get(channel, 0.0))
        self.channel_free[channel] = start + transfer
        key = (rank, task.peer, number)
        self.messages[key] = (clock, start + transfer + latency)
        self._wake(key)

    def _arrive(self, rank: int, task: Collective, clock: float) -> tuple:
        """Register ``rank`` at its next collective over ``task.group``; the last member fixes its window."""
        counter = (rank, task.group)
        number = self.collective_count.get(counter, 0)
        self.collective_count[counter] = number + 1
        key = (task.group, number)
        self.current[rank] = key
        arrived = self.arrivals.get(key)
        if arrived is None:
            arrived = self.arrivals[key] = [0, clock]
        arrived[0] += 1
        if clock > arrived[1]:
            arrived[1] = clock
        if arrived[0] == len(task.group):
            del self.arrivals[key]
            start = arrived[1]
            for member in task.group:
                start = max(start, self.comm_free.get((member, task.group), 0.0))
            cost_key = (task.kind, task.group, task.nbytes)
            seconds = self.collective_cache.get(cost_key)
            if seconds is None:
                seconds = self.collective_cache[cost_key] = self.comm.collective_seconds(task.kind, task.group, task.nbytes)
            end = start + seconds
            for member in task.group:
                self.comm_free[member, task.group] = end
            self.windows[key] = (start, end)
            self._wake(key)
        return key

    def _wait(self, rank: int, clock: float, peers_ready: float, done: float, kind: str, label: str) -> float:
        """Blocked from ``clock`` until ``done``: idle until ``peers_ready``, communication after it."""
        if done <= clock:
            return clock
        transfer_from = max(clock, min(peers_ready, done))
        self.stats[rank].communication += done - transfer_from
        if self.record:
            if transfer_from > clock:
                self.spans[rank].append(Span("idle", clock, transfer_from))
            self.spans[rank].append(Span("communication", transfer_from, done, f"{kind} {label}".strip()))
        return done
