"""V-shaped schedules (Qi et al. 2024): p ranks, 2p stages, rank r holds stages r and 2p - 1 - r.

A microbatch runs down the ranks on the first chunk (stages 0 … p - 1) and back up on the second
(stages p … 2p - 1), so its last stage is on rank 0 beside its first: rank r's two stages hold half the
layers of a 1F1B stage each, and the backward of a microbatch finishes where its forward began. The
backward is split (``B`` input gradients, ``W`` weight gradients, as ``zb1``); a stage's activations are
held from its ``F`` to its ``W``, as ``metrics.peak_in_flight`` counts them.

Both generators list-schedule: at each moment every idle rank runs the first ready action in its
priority order; a first-chunk forward (a new microbatch entering the rank) waits while the rank's stash,
plus one slot reserved for the second-chunk forward of each microbatch still on its way back, would
exceed the memory limit (the paper's rule; ``ADMISSIONS`` lists two more, and the generators keep the best
order any of them makes). Their only difference is that limit, a share of 1F1B's peak on the same layers
(``one_f_one_b_peak``: 1F1B's stage r is the V's stages 2r and 2r + 1, and its rank r holds p - r of them).
By default each stage keeps as much as any other (``saved``: 1 each), so ZB-V's limit is 2p stage
activations; given each stage's saved bytes per microbatch, the limit is in bytes, and a stage that keeps
more (the head's logits, on rank 0 beside the embedding) counts for more. In unit time (F = B = W = 1, the
``metrics.Durations`` defaults) the priority is the paper's, B before F before W. Given each action's
``cost`` (a plan's stage costs: the first stage has no input gradients, so its B is empty and its W the
whole backward), they schedule in that time and keep the priority order whose step ends soonest, the
unit-time order among them, so that no order they return ends later under ``cost`` than the unit-time one.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import defaultdict, deque
from collections.abc import Callable, Sequence

from lightning_nnscaler.schedules.actions import B, F, W, Action, Kind, Schedule, require_positive
from lightning_nnscaler.schedules.validate import execute

Cost = Callable[[Action], float]
"""The duration of a compute action (stage, microbatch, kind) in any time unit."""
PAPER_PRIORITY = (B, F, W)
ADMISSIONS = ("rank", "path", "stash")
"""When a rank may run a forward within the memory limit (``_v_schedule``); the paper's is ``rank``."""


def zbv(ranks: int, microbatches: int, cost: Cost | None = None, saved: Sequence[float] | None = None) -> Schedule:
    """ZB-V (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §6; Qi et al. 2024, "Pipeline Parallelism
    with Controllable Memory", arXiv 2405.15362, V-ZB): 1F1B's activation peak per rank (2p stage activations
    when the stages keep alike), and B before F before W so the W's fill what would be bubbles (with ``cost``
    and ``saved``: see the module docstring)."""
    return _timed(ranks, microbatches, 1.0, cost, saved)


def v_half(ranks: int, microbatches: int, cost: Cost | None = None, saved: Sequence[float] | None = None) -> Schedule:
    """V-Half (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory", arXiv 2405.15362, §4): half of
    1F1B's activation peak per rank (p stage activations when the stages keep alike, at least 2). The tight
    limit costs bubble: this greedy order idles about a third of the step (1F1B: (p - 1) / (m + p - 1)). With
    ``cost`` and ``saved``: see the module docstring."""
    return _timed(ranks, microbatches, max(ranks, 2) / (2 * ranks), cost, saved)


def one_f_one_b_peak(saved: Sequence[float]) -> float:
    """The most a rank of 1F1B keeps on the layers of the V's ``len(saved)`` stages: its stage r is the V's stages
    2r and 2r + 1, of which its rank r holds p - r microbatches."""
    ranks = len(saved) // 2
    return max((ranks - rank) * (saved[2 * rank] + saved[2 * rank + 1]) for rank in range(ranks))


def _timed(ranks: int, microbatches: int, share: float, cost: Cost | None, saved: Sequence[float] | None) -> Schedule:
    """The soonest-ending under ``cost`` (default: unit time) of the schedules made in unit time with the paper's
    priority and, with ``cost``, in that time with each priority; each keeps ``share`` of 1F1B's peak (``saved``'s,
    default 1 per stage), under each of ``ADMISSIONS``."""
    saved = tuple(saved) if saved is not None else (1,) * (2 * ranks)
    if len(saved) != 2 * ranks or min(saved) < 0:
        raise ValueError(f"V schedule: saved must give 2 × ranks = {2 * ranks} sizes >= 0, got {list(saved)}")
    limit = share * one_f_one_b_peak(saved)
    runs = [(PAPER_PRIORITY, None)] + ([(order, cost) for order in itertools.permutations((B, F, W))] if cost is not None else [])
    made = []
    for (priority, timing), admission in itertools.product(runs, ADMISSIONS):
        try:
            made.append(_v_schedule(ranks, microbatches, limit=limit, priority=priority, saved=saved, cost=timing, admission=admission))
        except _Stuck:  # a rank full to its limit blocks the messages behind a microbatch's, or its return finds no room
            continue
    duration = cost or (lambda action: 1.0)
    return min(made, key=lambda schedule: execute(schedule, lambda action: duration(action) if action.kind.is_compute else 0.0).makespan)


def _v_schedule(
    ranks: int, microbatches: int, *, limit: float, priority: tuple[Kind, ...], saved: Sequence[float], cost: Cost | None = None,
    admission: str = "rank",
) -> Schedule:
    """List scheduling of the V placement in ``cost``'s time (default: unit time; see the module docstring), each rank
    keeping at most ``limit`` of ``saved`` (each stage's per microbatch) unless it holds nothing; compute-only actions.

    ``admission`` is when a rank may run a forward: ``rank``, a first-chunk forward if the microbatch and its return
    fit on the rank; ``path``, if they fit on it and, when it arrives, on every deeper rank (never stuck, where a
    deeper rank refusing a microbatch already sent holds the messages behind it, for pairs exchange messages in the
    order sent; but it may wait where ``rank`` would not); ``stash``, any forward whose stage fits beside what the
    rank holds now (nothing reserved: a finer limit, stuck where the returns find no room)."""
    require_positive(ranks=ranks, microbatches=microbatches)
    stages = 2 * ranks
    stage_ranks = tuple(min(stage, stages - 1 - stage) for stage in range(stages))
    done: dict[tuple[Kind, int, int], int] = {}  # (kind, stage, microbatch) -> end time
    following = {(kind, stage): 0 for kind in (F, B, W) for stage in range(stages)}  # next microbatch per (kind, stage)
    actions: list[list[Action]] = [[] for _ in range(ranks)]
    channels: dict[tuple[int, int], deque] = defaultdict(deque)  # (sender, receiver) -> the actions awaiting, in send order

    def ready(kind: Kind, stage: int, microbatch: int, time: float) -> bool:
        if microbatch >= microbatches:
            return False
        sender = _sender(kind, stage, stage_ranks)
        if sender is not None:
            waiting = channels[sender, stage_ranks[stage]]
            if not waiting or waiting[0] != (kind, stage, microbatch):
                return False
        if kind is F:
            return stage == 0 or done.get((F, stage - 1, microbatch), math.inf) <= time
        if kind is B:
            return done.get((F, stage, microbatch), math.inf) <= time and (stage == stages - 1 or done.get((B, stage + 1, microbatch), math.inf) <= time)
        return done.get((B, stage, microbatch), math.inf) <= time

    def fits(rank: int, arriving: int) -> bool:  # ``arriving`` more microbatches on the rank's first chunk, return slots reserved
        first, second = rank, stages - 1 - rank
        held = sum((following[F, stage] - following[W, stage]) * saved[stage] for stage in (first, second))
        held += (following[F, first] - following[F, second]) * saved[second]
        return (held == 0 and arriving == 1) or held + arriving * (saved[first] + saved[second]) <= limit * (1 + 1e-9)

    def admits(rank: int, stage: int) -> bool:  # a forward of ``stage`` on ``rank`` keeps the limit (see ``admission``)
        if admission == "stash":
            held = sum((following[F, own] - following[W, own]) * saved[own] for own in (rank, stages - 1 - rank))
            return held == 0 or held + saved[stage] <= limit * (1 + 1e-9)
        deepest = ranks if admission == "path" else rank + 1
        return stage != rank or all(fits(deeper, following[F, rank] - following[F, deeper] + 1) for deeper in range(rank, deepest))

    duration = cost or (lambda action: 1.0)
    busy_until = [0.0] * ranks
    endings: list[float] = []  # the end times of the actions running or run (a heap)
    time, total = 0.0, 3 * stages * microbatches
    while len(done) < total:
        for rank in range(ranks):
            if busy_until[rank] > time:
                continue
            for kind in priority:
                # the second chunk first: it finishes microbatches (forward) and is the earlier backward
                candidates = [(kind, stage, following[kind, stage]) for stage in (stages - 1 - rank, rank)]
                chosen = next((c for c in candidates if ready(*c, time) and (kind is not F or admits(rank, c[1]))), None)
                if chosen is not None:
                    action = Action(chosen[1], chosen[2], kind)
                    done[chosen] = busy_until[rank] = time + duration(action)
                    heapq.heappush(endings, done[chosen])
                    if _sender(kind, chosen[1], stage_ranks) is not None:
                        channels[_sender(kind, chosen[1], stage_ranks), rank].popleft()
                    after = (kind, chosen[1] + (1 if kind is F else -1), chosen[2])  # the action its message feeds
                    if kind is not W and 0 <= after[1] < stages and stage_ranks[after[1]] != rank:
                        channels[rank, stage_ranks[after[1]]].append(after)
                    following[kind, chosen[1]] += 1
                    actions[rank].append(action)
                    break
        while endings and endings[0] <= time:
            heapq.heappop(endings)
        if not endings and len(done) < total:
            raise _Stuck(f"V schedule for ranks={ranks}, microbatches={microbatches} made no progress (limit {limit})")
        time = endings[0] if endings else time
    return Schedule(actions, stage_ranks, microbatches)


class _Stuck(RuntimeError):
    """No rank of a V schedule being made can run anything."""


def _sender(kind: Kind, stage: int, stage_ranks: tuple[int, ...]) -> int | None:
    """The rank whose message ``kind`` on ``stage`` waits for (F: the previous stage's, B: the next's), if another."""
    source = stage - 1 if kind is F else stage + 1 if kind is B else -1
    return stage_ranks[source] if 0 <= source < len(stage_ranks) and stage_ranks[source] != stage_ranks[stage] else None
