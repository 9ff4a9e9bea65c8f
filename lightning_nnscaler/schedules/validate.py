"""Validation before any process starts: structure, then a symbolic execution of every rank's list.

Structure: every action names a stage and microbatch in range, on the rank that holds the stage;
every (stage, microbatch) has exactly one F and one B (and one W when backward is split); a lowered
schedule has exactly the sends and receives ``lower`` would insert.

Execution: one cursor per rank. A compute action runs once its dependencies ran — F(s, m) after
F(s-1, m); B(s, m) after F(s, m) and B(s+1, m); W(s, m) after B(s, m); across ranks, also after the
RECV that brings the tensor. A SEND never blocks (isend). A RECV runs only after its matching SEND:
the k-th receive from a rank pairs with the k-th send to it, activations and gradients alike (NCCL
matches point-to-point operations between two ranks in the order they are posted, ignoring tags), and
must be the message that send carries — otherwise the order is crossed. When no cursor can move before all
lists end, the schedule deadlocks. Each failure raises ``ScheduleError`` with the step × rank grid
and the failing actions marked.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from lightning_nnscaler.ir.errors import NnScalerError
from lightning_nnscaler.schedules.actions import Action, Kind, Schedule, Timeline
from lightning_nnscaler.schedules.lower import communication_around
from lightning_nnscaler.schedules.render import grid

Key = tuple  # what an action waits for: a compute/recv Action's identity, or ("send", channel, k)


class ScheduleError(NnScalerError, ValueError):
    """A schedule that would fail or hang at run time; the message holds the marked step × rank grid."""


def validate(schedule: Schedule) -> Timeline:
    """Check ``schedule`` and return when each action runs with unit durations (one step per action).

    Linear in the number of actions: each action is tried once, plus once more per dependency it waits on.

    Raises:
        ScheduleError: naming the problem, with the grid (crossed send/recv order, an action before its
            dependency, a cross-rank cycle, a missing or duplicated action).
    """
    check_structure(schedule)
    return execute(schedule, lambda action: 1.0)


def check_structure(schedule: Schedule) -> None:
    """Stages, microbatches and peers in range and placed right; each F/B(/W) exactly once; comms complete."""
    for rank, rank_actions in enumerate(schedule.actions):
        for index, action in enumerate(rank_actions):
            problem = _placement_problem(schedule, rank, action)
            if problem:
                _fail(schedule, f"rank {rank} step {index}: {action} {problem}", None, [(rank, index)])
    kinds = (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT) if schedule.splits_backward else (Kind.FORWARD, Kind.BACKWARD)
    lowered = any(not action.kind.is_compute for rank_actions in schedule.actions for action in rank_actions)
    problems, marked = [], []
    for rank, rank_actions in enumerate(schedule.actions):
        counts = Counter(rank_actions)
        expected = Counter(Action(stage, microbatch, kind) for stage in schedule.stages_of_rank(rank)
                           for microbatch in range(schedule.microbatches) for kind in kinds
                           if kind is Kind.FORWARD or schedule.has_backward(stage))
        if lowered:
            expected += Counter(comm for action in list(expected) for part in communication_around(schedule, action, rank) for comm in part)
        missing, extra = expected - counts, counts - expected
        marked += [(rank, index) for index, action in enumerate(rank_actions) if action in extra]
        labelled = [("missing actions", missing), ("unexpected or repeated actions", extra)]
        problems += [f"rank {rank}: {label} {_texts(actions)}" for label, actions in labelled if actions]
    if problems:
        _fail(schedule, "; ".join(problems), None, marked)


def _placement_problem(schedule: Schedule, rank: int, action: Action) -> str:
    if action.stage >= schedule.stages:
        return f"names stage {action.stage}, but the schedule has {schedule.stages} stages"
    if action.microbatch >= schedule.microbatches:
        return f"names microbatch {action.microbatch}, but the schedule has {schedule.microbatches} microbatches"
    if rank not in schedule.holders(action.stage):
        return f"runs on rank {rank}, but stage {action.stage} is held by rank {schedule.stage_ranks[action.stage]}"
    if action.peer is not None and action.peer >= schedule.world_size:
        return f"names peer rank {action.peer}, but the schedule has {schedule.world_size} ranks"
    return ""


def _texts(actions: Counter) -> str:
    return "[" + ", ".join(str(action) for action in sorted(actions.elements())) + "]"


def _fail(schedule: Schedule, message: str, timeline: Timeline | None, marked: list[tuple[int, int]]) -> None:
    raise ScheduleError(f"{message}\n{grid(schedule, timeline, mark=set(marked))}")


def _channel(action: Action, rank: int) -> tuple[int, int]:
    """(sender, receiver) of a SEND or RECV run by ``rank``: messages between two ranks pair in order."""
    return (rank, action.peer) if action.kind.is_send else (action.peer, rank)


def dependencies(schedule: Schedule, rank: int, action: Action, recv_index: int, lowered: bool) -> list[Key]:
    """What ``action`` on ``rank`` waits for.

    ``recv_index`` is a RECV's position on its channel; ``lowered`` says whether cross-rank inputs arrive
    by RECV actions (then a compute action also waits for the receives ``lower`` puts before it).
    """
    stage, microbatch, kind = action.stage, action.microbatch, action.kind
    if kind.is_recv:
        return [("send", _channel(action, rank), recv_index)]
    if kind is Kind.FORWARD:
        keys: list[Key] = [(stage - 1, microbatch, Kind.FORWARD, None)] if stage > 0 else []
    elif kind is Kind.BACKWARD:
        keys = [(stage, microbatch, Kind.FORWARD, None)] + ([(stage + 1, microbatch, Kind.BACKWARD, None)] if stage + 1 < schedule.stages else [])
    else:
        keys = [(stage, microbatch, _USES[kind], None)]
    if lowered and kind.is_compute:
        keys += [_identity(receive) for receive in communication_around(schedule, action, rank)[0]]
    if kind.is_compute and schedule.is_shared(stage):
        keys.append(("all", _identity(action)))  # a shared stage runs like a collective: every rank together
    return keys


_USES = {Kind.WEIGHT: Kind.BACKWARD, Kind.SEND_F: Kind.FORWARD, Kind.SEND_B: Kind.BACKWARD}
"""The action of the same segment whose result a W uses or a SEND sends."""


def _identity(action: Action) -> Key:
    return (action.stage, action.microbatch, action.kind, action.peer)


def execute(schedule: Schedule, duration: Callable[[Action], float]) -> Timeline:
    """Run every rank's list symbolically; each action starts when its rank is free and its dependencies ended.

    Event-driven: a blocked rank sleeps on the one key it waits for and wakes when that key completes, so
    the cost is linear in the number of actions. Start times are as-soon-as-possible given the order.

    Raises:
        ScheduleError: on a crossed send/recv order or a deadlock (with the grid and the stuck actions marked).
    """
    run = _Run(schedule, duration)
    ready = deque(range(schedule.world_size))
    while ready:
        ready.extend(run.advance(ready.popleft()))
    stuck = [rank for rank in range(schedule.world_size) if run.cursor[rank] < len(schedule.actions[rank])]
    if stuck:
        _fail(schedule, "deadlock: " + _explain_deadlock(run, stuck), run.timeline(), [(rank, run.cursor[rank]) for rank in stuck])
    return run.timeline()


@dataclass
class _Run:
    """The state of one symbolic execution: cursors, clocks, completed keys and sleeping ranks."""

    schedule: Schedule
    duration: Callable[[Action], float]
    cursor: list[int] = field(init=False)
    clock: list[float] = field(init=False)
    starts: list[list[float | None]] = field(init=False)
    ends: list[list[float | None]] = field(init=False)
    done: dict[Key, float] = field(default_factory=dict)
    sent: dict[Key, tuple[int, int]] = field(default_factory=dict)  # send key → (rank, index) of the SEND
    messages: Counter = field(default_factory=Counter)  # ("send" | "recv", channel) → count so far
    waiting: dict[Key, list[int]] = field(default_factory=dict)
    blocked: dict[int, Key] = field(default_factory=dict)
    arrived: dict[Key, dict[int, float]] = field(default_factory=dict)  # shared action → rank → when it got there

    def __post_init__(self) -> None:
        world_size = self.schedule.world_size
        self.cursor, self.clock = [0] * world_size, [0.0] * world_size
        self.starts = [[None] * len(rank_actions) for rank_actions in self.schedule.actions]
        self.ends = [[None] * len(rank_actions) for rank_actions in self.schedule.actions]
        self.lowered = any(not action.kind.is_compute for rank_actions in self.schedule.actions for action in rank_actions)

    def advance(self, rank: int) -> list[int]:
        """Run ``rank``'s actions until it blocks or ends; return the ranks this woke."""
        woken: list[int] = []
        rank_actions = self.schedule.actions[rank]
        while self.cursor[rank] < len(rank_actions):
            index = self.cursor[rank]
            action = rank_actions[index]
            channel = None if action.kind.is_compute else _channel(action, rank)
            needs = dependencies(self.schedule, rank, action, self.messages["recv", channel], self.lowered)
            missing = next((key for key in needs if key not in self.done and key[0] != "all"), None)
            if missing is None:
                missing, woken_by_arrival = self._arrive(rank, needs)
                woken += woken_by_arrival
            if missing is not None:
                self.waiting.setdefault(missing, []).append(rank)
                self.blocked[rank] = missing
                return woken
            if action.kind.is_recv:
                self._check_pairing(rank, index, action, needs[0])
            start = max([self.clock[rank], *(self.done[key] for key in needs)])
            end = start + self.duration(action)
            self.starts[rank][index], self.ends[rank][index], self.clock[rank] = start, end, end
            self.cursor[rank] += 1
            self.blocked.pop(rank, None)
            completed = [_identity(action)]
            if action.kind.is_send:
                completed.append(("send", channel, self.messages["send", channel]))
                self.sent[completed[-1]] = (rank, index)
            self.messages["send" if action.kind.is_send else "recv", channel] += 1
            for key in completed:
                self.done[key] = end
                woken += self.waiting.pop(key, [])
        return woken

    def _arrive(self, rank: int, needs: list[Key]) -> tuple[Key | None, list[int]]:
        """At a shared stage's action: note that ``rank`` reached it; the key it still waits for (until
        every rank has), and the ranks the last arrival wakes."""
        together = next((key for key in needs if key[0] == "all"), None)
        if together is None or together in self.done:
            return None, []
        arrived = self.arrived.setdefault(together, {})
        arrived[rank] = max([self.clock[rank], *(self.done[key] for key in needs if key != together)])
        if len(arrived) < self.schedule.world_size:
            return together, []
        self.done[together] = max(arrived.values())
        return None, [peer for peer in self.waiting.pop(together, []) if peer != rank]

    def _check_pairing(self, rank: int, index: int, action: Action, send_key: Key) -> None:
        """The k-th send on a channel must carry what the k-th receive expects, or the order is crossed."""
        send_rank, send_index = self.sent[send_key]
        sent = self.schedule.actions[send_rank][send_index]
        expected = (Kind.SEND_F, action.stage - 1) if action.kind is Kind.RECV_F else (Kind.SEND_B, action.stage + 1)
        if (sent.kind, sent.stage, sent.microbatch) != (*expected, action.microbatch):
            sender, receiver = send_key[1]
            _fail(
                self.schedule,
                f"crossed send/recv order from rank {sender} to rank {receiver}: message {send_key[2]} "
                f"is {sent} on rank {sender}, but rank {receiver} receives it as {action}; "
                f"both ranks must send and receive in the same order",
                self.timeline(),
                [(rank, index), (send_rank, send_index)],
            )

    def timeline(self) -> Timeline:
        """The start and end times so far (None for actions that have not run)."""
        return Timeline(tuple(map(tuple, self.starts)), tuple(map(tuple, self.ends)))


def _explain_deadlock(run: _Run, stuck: list[int]) -> str:
    """Name what each stuck rank waits for, and the cross-rank cycle when there is one."""
    waits_for: dict[int, int] = {}
    lines = []
    for rank in stuck:
        key = run.blocked[rank]
        action = run.schedule.actions[rank][run.cursor[rank]]
        if key[0] == "send":
            (sender, receiver), number = key[1], key[2]
            producer, awaited = sender, f"message {number} from rank {sender} to rank {receiver}"
        elif key[0] == "all":
            absent = [peer for peer in range(run.schedule.world_size) if peer not in run.arrived.get(key, {})]
            producer, awaited = absent[0], f"every rank to reach {Action(*key[1])} (a shared stage: all ranks run it together); rank {absent[0]} has not"
        else:
            awaited_action = Action(*key)
            holders = run.schedule.holders(awaited_action.stage)
            producer = next((peer for peer in holders if run.cursor[peer] < len(run.schedule.actions[peer])), holders[0])
            awaited = str(awaited_action)
        waits_for[rank] = producer
        if producer == rank:
            where = f"which rank {rank} runs later in its own list" + _hint(action, key)
        elif run.cursor[producer] >= len(run.schedule.actions[producer]):
            where = f"which rank {producer} never runs (its list ended)"
        else:
            where = f"on rank {producer}, itself stuck at {run.schedule.actions[producer][run.cursor[producer]]}"
        lines.append(f"rank {rank} is stuck at {action} (step {run.clock[rank]:g}), waiting for {awaited}, {where}")
    cycle = _cycle(waits_for)
    if len(cycle) > 1:
        lines.append("cross-rank cycle: " + " -> ".join(f"rank {rank}" for rank in [*cycle, cycle[0]]))
    return "\n".join(lines)


def _hint(action: Action, key: Key) -> str:
    if action.kind is Kind.BACKWARD and key[2] is Kind.FORWARD and key[:2] == (action.stage, action.microbatch):
        return " (a backward before its forward)"
    if action.kind.is_compute and key[0] != "send" and Kind(key[2]).is_recv:
        return " (a receive after the action that needs it)"
    return ""


def _cycle(waits_for: dict[int, int]) -> list[int]:
    """A cycle in the rank → awaited-rank graph (each rank waits on one other), or []."""
    for start in waits_for:
        path: list[int] = []
        rank = start
        while rank in waits_for and rank not in path:
            path.append(rank)
            rank = waits_for[rank]
        if rank in path:
            return path[path.index(rank):]
    return []
