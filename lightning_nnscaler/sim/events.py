"""The event-driven engine: ranks that share a node's cores slow each other down (processor sharing).

A heap of events in time order (compute ends, wake-ups). With ``k`` ranks computing on a node of
``c`` cores each runs at ``min(1, c / k)``; every start or end of a compute task on the node
re-rates the others. ``simulate`` uses it when ``Machine.cores_per_node`` is set.

Issuing a send or starting an asynchronous collective while the node's other cores all compute holds the rank for
``Machine.busy_issue_seconds`` (counted as communication): the backend's communication thread must first
get a core, and the issuing call waits for it (gloo over loopback: a scheduler time slice, milliseconds).
A receive posted after its message was sent returns ``Machine.late_receive_seconds`` after it was posted at
the earliest (counted as communication): gloo moves a message when its receive asks for it, so the
sender's communication thread must be scheduled again. A receive posted first only waits for the message, and
so does one the runtime posted where its message was sent (``Recv.posted``).

With ``Machine.compute_jitter`` or ``Machine.meeting_jitter_seconds`` set, a rank's clock is uncertain
(``sim.jitter``): by ``meeting_jitter_seconds`` when it leaves a wait for other ranks (or starts the step), plus
``compute_jitter`` × the compute it ran since. A collective starts at the expected latest arrival of its
members and the step ends at the expected latest end of the ranks. A receive returns at the expected later of
its own posting and its message's arrival only where a node's ranks outnumber its cores: there a message does
not start its receiver, the scheduler does, and the two clocks stay apart. Where each rank has a core, a message
couples its two clocks (pipeline stages exchange one every few milliseconds): treating them as independent at
every receive priced the benchmark's GPT pipelines on 2 bound ranks 12-19 % high, against 3-14 % without it,
and dropping it on 4 ranks sharing 2 cores priced their 1F1B 15 % low, against 8 % with it.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence

from lightning_nnscaler.sim.jitter import chance_first, later_of, latest
from lightning_nnscaler.sim.results import CommunicationModel, Machine, RankStats, Span
from lightning_nnscaler.sim.tasks import Collective, Compute, Recv, Send, Task, WaitCollectives

_READY, _COMPUTING, _BLOCKED = 0, 1, 2


class EventRun:
    """The state of one simulation (see ``simulate``)."""

    def __init__(self, lists: Sequence[Sequence[Task]], comm: CommunicationModel, machine: Machine, record: bool) -> None:
        self.lists, self.comm, self.machine, self.record = lists, comm, machine, record
        self.world = len(lists)
        self.cursor = [0] * self.world
        self.state = [_READY] * self.world
        self.stats = [RankStats() for _ in range(self.world)]
        self.spans: list[list[Span]] = [[] for _ in range(self.world)]
        self.blocked_since: list[float | None] = [None] * self.world
        self.live = [0] * self.world
        self.held = [0] * self.world
        self.started = [0.0] * self.world
        self.now = 0.0
        self.events: list[tuple[float, int, int, int]] = []  # (time, sequence, rank, compute version or -wake token)
        self.sequence = 0
        self.version = [0] * self.world
        self.wake_token = [0] * self.world  # a blocked rank waits for one thing: only its latest wake-up counts
        self.sent: dict[tuple[int, int], int] = {}
        self.received: dict[tuple[int, int], int] = {}
        self.messages: dict[tuple[int, int, int], tuple[float, float, float]] = {}  # (src, dst, k) -> (posted, arrives, sender's spread)
        self.channel_free: dict[tuple[int, int], float] = {}
        self.message_waiter: dict[tuple[int, int, int], int] = {}
        self.collective_count: dict[tuple[int, tuple[int, ...]], int] = {}
        self.arrivals: dict[tuple, dict[int, tuple[float, float]]] = {}  # collective -> member -> (arrived, spread)
        self.collective_window: dict[tuple, tuple[float, float]] = {}  # key -> (start, end)
        self.current_collective: list[tuple | None] = [None] * self.world
        self.pending: list[list[tuple]] = [[] for _ in range(self.world)]
        self.comm_free: dict[tuple[int, tuple[int, ...]], float] = {}  # (rank, group) -> when its stream is free
        self.shared = machine.cores_per_node is not None
        self.active: dict[int, dict[int, list[float]]] = {}  # node -> rank -> [remaining work, rate]
        self.last_update: dict[int, float] = {}
        self.issue_until: list[float | None] = [None] * self.world  # a rank held by its issue: until when
        self.late_until: dict[tuple[int, int, int], float] = {}  # a message received late: when its receive returns
        self.waited: set[tuple[int, int, int]] = set()  # messages whose receive was posted before them
        self.jitter = machine.compute_jitter if self.shared else 0.0
        self.met = machine.meeting_jitter_seconds if self.shared else 0.0
        self.noisy = bool(self.jitter or self.met)
        self.spread = [self.met] * self.world  # a rank clock's standard deviation since it last met others (sim.jitter)
        time_shared = self.shared and min(self.world, machine.ranks_per_node) > machine.cores_per_node
        self.noisy_receives = self.noisy and time_shared  # see the module docstring
        self.jitter_until: dict[tuple[int, int, int], tuple[float, float]] = {}  # message -> (expected return, receiver's spread after)

    def go(self) -> None:
        """Advance ready ranks at ``now``, then take the next event in time order, until none is left."""
        ready = deque(range(self.world))
        while True:
            while ready:
                rank = ready.popleft()
                if self.state[rank] == _READY:
                    self.advance(rank)
            if not self.events:
                return
            time, _, rank, version = heapq.heappop(self.events)
            self.now = time
            if version < 0:
                if self.state[rank] == _BLOCKED and -version == self.wake_token[rank]:
                    self.state[rank] = _READY
                    ready.append(rank)
            elif version == self.version[rank] and self.state[rank] == _COMPUTING:
                self.finish_compute(rank)
                ready.append(rank)

    def push(self, time: float, rank: int, version: int | None = None) -> None:
        """Queue ``rank``'s compute end (``version``) or, without one, a wake-up that replaces any earlier one."""
        self.sequence += 1
        if version is None:
            self.wake_token[rank] += 1
            version = -self.wake_token[rank]
        heapq.heappush(self.events, (time, self.sequence, rank, version))

    def advance(self, rank: int) -> None:
        """Run ``rank``'s tasks at ``now`` until it computes, blocks or ends."""
        tasks = self.lists[rank]
        while self.cursor[rank] < len(tasks):
            task = tasks[self.cursor[rank]]
            kind = type(task)
            if kind is Compute:
                self.start_compute(rank, task)
                return
            if kind is Send:
                if not self.issued(rank, task.label):
                    return
                self.post(rank, task)
            elif kind is Recv:
                if not self.receive(rank, task):
                    return
            elif kind is Collective:
                if not self.collective(rank, task):
                    return
            elif not self.wait_collectives(rank):
                return
            self.cursor[rank] += 1
        self.stats[rank].end = self.now

    # --- compute -------------------------------------------------------------------------------------

    def start_compute(self, rank: int, task: Compute) -> None:
        self.state[rank] = _COMPUTING
        stats = self.stats[rank]
        stats.note_live(self.live[rank] + self.held[rank] + stats.gradient_bytes + task.transient_bytes)
        self.live[rank] += task.activation_bytes
        self.held[rank] += task.held_bytes
        stats.gradient_bytes += task.gradient_bytes  # made while the task frees its activations: counted after it
        stats.peak_activation_bytes = max(stats.peak_activation_bytes, self.live[rank])
        stats.note_live(self.live[rank] + self.held[rank] + stats.gradient_bytes)
        self.started[rank] = self.now
        if not self.shared:
            self.version[rank] += 1
            self.push(self.now + task.seconds, rank, self.version[rank])
            return
        node = rank // self.machine.ranks_per_node
        self._reshare(node)
        self.active.setdefault(node, {})[rank] = [task.seconds, 1.0]
        self._reshare(node, changed=True)

    def finish_compute(self, rank: int) -> None:
        task = self.lists[rank][self.cursor[rank]]
        start = self.started[rank]
        self.stats[rank].busy += self.now - start
        self.spread[rank] += self.jitter * (self.now - start)
        if self.record:
            self.spans[rank].append(Span(task.kind, start, self.now, task.label))
        if self.shared:
            node = rank // self.machine.ranks_per_node
            self._reshare(node)
            del self.active[node][rank]
            self._reshare(node, changed=True)
        self.state[rank] = _READY
        self.cursor[rank] += 1

    def _reshare(self, node: int, changed: bool = False) -> None:
        """Bring the node's running tasks' remaining work up to ``now``; after a change, new rates and end events."""
        running = self.active.get(node, {})
        elapsed = self.now - self.last_update.get(node, self.now)
        for work in running.values():
            work[0] -= elapsed * work[1]
        self.last_update[node] = self.now
        if not changed or not running:
            return
        rate = min(1.0, self.machine.cores_per_node / len(running))
        for rank, work in running.items():
            work[1] = rate
            self.version[rank] += 1
            self.push(self.now + max(work[0], 0.0) / rate, rank, self.version[rank])

    # --- point to point ------------------------------------------------------------------------------

    def post(self, rank: int, task: Send) -> None:
        self.stats[rank].sent_bytes += task.nbytes
        channel = (rank, task.peer)
        number = self.sent.get(channel, 0)
        self.sent[channel] = number + 1
        latency, transfer = self.comm.p2p_seconds(rank, task.peer, task.nbytes)
        start = max(self.now, self.channel_free.get(channel, 0.0))
        self.channel_free[channel] = start + transfer
        key = (rank, task.peer, number)
        self.messages[key] = (self.now, start + transfer + latency, self.spread[rank])
        waiter = self.message_waiter.pop(key, None)
        if waiter is not None:
            self.push(start + transfer + latency, waiter)

    def receive(self, rank: int, task: Recv) -> bool:
        channel = (task.peer, rank)
        key = (task.peer, rank, self.received.get(channel, 0))
        since = self._block_start(rank)
        message = self.messages.get(key)
        if message is None:
            self.message_waiter[key] = rank
            self.waited.add(key)
            return self._block(rank)
        posted, arrives, sender_spread = message
        if self.shared and self.machine.late_receive_seconds and key not in self.waited and not task.posted:  # see the module docstring
            arrives = max(arrives, self.late_until.setdefault(key, self.now + self.machine.late_receive_seconds))
        if self.noisy_receives:
            if key not in self.jitter_until:
                mine, theirs = (since, self.spread[rank]), (arrives, sender_spread)
                waited = chance_first(mine, theirs)
                self.jitter_until[key] = (later_of(mine, theirs)[0], self.spread[rank] * (1.0 - waited) + self.met * waited)
            arrives = max(arrives, self.jitter_until[key][0])
        if arrives > self.now:
            self.push(arrives, rank)
            return self._block(rank)
        self.waited.discard(key)
        self.late_until.pop(key, None)
        self.received[channel] = key[2] + 1
        del self.messages[key]
        if self.noisy_receives:
            self.spread[rank] = self.jitter_until.pop(key)[1]  # as far as the receiver waited, it met the sender
        self.stats[rank].sent_bytes -= task.releases
        self._account_wait(rank, since, max(since, posted), "recv", task.label)
        return True

    # --- collectives ---------------------------------------------------------------------------------

    def collective(self, rank: int, task: Collective) -> bool:
        key = self.current_collective[rank]
        if key is None and not task.blocking and not self.issued(rank, task.label):
            return False
        if key is None:
            counter = (rank, task.group)
            number = self.collective_count.get(counter, 0)
            self.collective_count[counter] = number + 1
            key = (task.group, number)
            self.current_collective[rank] = key
            members = self.arrivals.setdefault(key, {})
            members[rank] = (self.now, self.spread[rank])
            if len(members) == len(task.group):
                self._resolve(key, task)
            if not task.blocking:
                self.pending[rank].append(key)
                self.current_collective[rank] = None
                return True
        since = self._block_start(rank)
        window = self.collective_window.get(key)
        if window is None:
            return self._block(rank)
        start, end = window
        if end > self.now:
            self.push(end, rank)
            return self._block(rank)
        self.current_collective[rank] = None
        self.spread[rank] = self.met  # every member leaves the collective together
        self._account_wait(rank, since, max(since, start), task.kind, task.label)
        return True

    def _resolve(self, key: tuple, task: Collective) -> None:
        """The last member arrived: the collective runs once every member's communication stream is free."""
        members = self.arrivals.pop(key)
        last = latest(members.values())[0] if self.noisy else max(arrived for arrived, _ in members.values())
        start = max(last, *(self.comm_free.get((member, task.group), 0.0) for member in task.group))
        end = start + self.comm.collective_seconds(task.kind, task.group, task.nbytes)
        self.collective_window[key] = (start, end)
        for member in task.group:
            self.comm_free[member, task.group] = end
            if self.state[member] != _BLOCKED:
                continue
            if self.current_collective[member] == key or type(self.lists[member][self.cursor[member]]) is WaitCollectives:
                self.push(end, member)

    def wait_collectives(self, rank: int) -> bool:
        since = self._block_start(rank)
        windows = [self.collective_window.get(key) for key in self.pending[rank]]
        if any(window is None for window in windows):
            return self._block(rank)
        end = max((window[1] for window in windows), default=self.now)
        if end > self.now:
            self.push(end, rank)
            return self._block(rank)
        start = min((window[0] for window in windows), default=self.now)
        self.pending[rank] = []
        if since < self.now:  # it waited for the collectives' last member
            self.spread[rank] = self.met
        self._account_wait(rank, since, max(since, min(start, self.now)), "wait", "collectives")
        return True

    def issued(self, rank: int, label: str) -> bool:
        """Whether ``rank`` has issued its send or joined its collective; False while the issue holds it (see the
        module docstring), with its wake-up queued."""
        until = self.issue_until[rank]
        if until is not None:
            if until > self.now:
                return self._block(rank)
            self.issue_until[rank] = None
            self._account_wait(rank, self._block_start(rank), self.blocked_since[rank], "issue", label)
            return True
        delay = self.machine.busy_issue_seconds
        if not delay or not self.shared:
            return True
        node = rank // self.machine.ranks_per_node
        if len(self.active.get(node, {})) + 1 < self.machine.cores_per_node:
            return True  # a core is free for the communication thread
        self._block_start(rank)
        self.issue_until[rank] = self.now + delay
        self.push(self.now + delay, rank)
        return self._block(rank)

    def expected_end(self) -> float:
        """The expected latest end of the ranks' lists, their clocks' spread counted (``sim.jitter``)."""
        return latest((stats.end, spread) for stats, spread in zip(self.stats, self.spread, strict=True))[0]

    # --- accounting ----------------------------------------------------------------------------------

    def _block_start(self, rank: int) -> float:
        if self.blocked_since[rank] is None:
            self.blocked_since[rank] = self.now
        return self.blocked_since[rank]

    def _block(self, rank: int) -> bool:
        self.state[rank] = _BLOCKED
        return False

    def _account_wait(self, rank: int, since: float, peers_ready: float, kind: str, label: str) -> None:
        """A wait from ``since`` to ``now``: idle until ``peers_ready``, communication after it."""
        self.blocked_since[rank] = None
        self.state[rank] = _READY
        transfer_from = min(peers_ready, self.now)
        self.stats[rank].communication += self.now - transfer_from
        if self.record:
            if transfer_from > since:
                self.spans[rank].append(Span("idle", since, transfer_from))
            if self.now > transfer_from:
                self.spans[rank].append(Span("communication", transfer_from, self.now, f"{kind} {label}".strip()))
