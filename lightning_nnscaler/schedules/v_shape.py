"""V-shaped schedules (Qi et al. 2024): p ranks, 2p stages, rank r holds stages r and 2p - 1 - r.

A microbatch runs down the ranks on the first chunk (stages 0 … p - 1) and back up on the second
(stages p … 2p - 1), so its last stage is on rank 0 beside its first: rank r's two stages hold half the
layers of a 1F1B stage each, and the backward of a microbatch finishes where its forward began. The
backward is split (``B`` input gradients, ``W`` weight gradients, as ``zb1``); a stage's activations are
held from its ``F`` to its ``W``, as ``metrics.peak_in_flight`` counts them.

Both generators list-schedule in unit time (F = B = W = 1, the ``metrics.Durations`` defaults): at each
step every idle rank runs the first ready action in its priority order; a first-chunk forward (a new
microbatch entering the rank) waits while the rank's stash, plus one slot reserved for the second-chunk
forward of each microbatch still on its way back, would exceed the memory limit. Their only difference is
that limit and the priorities.
"""

from __future__ import annotations

from collections import defaultdict, deque

from lightning_nnscaler.schedules.actions import B, F, W, Action, Kind, Schedule, require_positive


def zbv(ranks: int, microbatches: int) -> Schedule:
    """ZB-V (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §6; Qi et al. 2024, "Pipeline Parallelism
    with Controllable Memory", arXiv 2405.15362, V-ZB): at most 2p stage activations per rank, i.e. 1F1B's
    peak of p full stages, and B before F before W so the W's fill what would be bubbles."""
    return _v_schedule(ranks, microbatches, limit=2 * ranks, priority=(B, F, W))


def v_half(ranks: int, microbatches: int) -> Schedule:
    """V-Half (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory", arXiv 2405.15362, §4): at
    most p stage activations per rank (half-size stages: half of 1F1B's peak). The tight limit costs bubble:
    this greedy order idles about a third of the step (1F1B: (p - 1) / (m + p - 1))."""
    return _v_schedule(ranks, microbatches, limit=max(ranks, 2), priority=(B, F, W))


def _v_schedule(ranks: int, microbatches: int, *, limit: int, priority: tuple[Kind, ...]) -> Schedule:
    """Unit-time list scheduling of the V placement (see the module docstring); compute-only actions."""
    require_positive(ranks=ranks, microbatches=microbatches)
    stages = 2 * ranks
    stage_ranks = tuple(min(stage, stages - 1 - stage) for stage in range(stages))
    done: dict[tuple[Kind, int, int], int] = {}  # (kind, stage, microbatch) -> end time
    following = {(kind, stage): 0 for kind in (F, B, W) for stage in range(stages)}  # next microbatch per (kind, stage)
    actions: list[list[Action]] = [[] for _ in range(ranks)]
    channels: dict[tuple[int, int], deque] = defaultdict(deque)  # (sender, receiver) -> the actions awaiting, in send order

    def ready(kind: Kind, stage: int, microbatch: int, time: int) -> bool:
        needs = {F: [(F, stage - 1)] if stage else [], B: [(F, stage)] + ([(B, stage + 1)] if stage < stages - 1 else []),
                 W: [(B, stage)]}[kind]
        sender = _sender(kind, stage, stage_ranks)
        in_order = sender is None or list(channels[sender, stage_ranks[stage]])[:1] == [(kind, stage, microbatch)]
        return microbatch < microbatches and in_order and all(done.get((need, at, microbatch), time + 1) <= time for need, at in needs)

    def fits(rank: int) -> bool:  # a new microbatch on the rank's first chunk, with its return slot reserved
        first, second = rank, stages - 1 - rank
        held = sum(following[F, stage] - following[W, stage] for stage in (first, second))
        return held + (following[F, first] - following[F, second]) + 2 <= limit

    time, total = 0, 3 * stages * microbatches
    while len(done) < total:
        if time > 4 * total:
            raise RuntimeError(f"V schedule for ranks={ranks}, microbatches={microbatches} made no progress (limit {limit})")
        for rank in range(ranks):
            for kind in priority:
                # the second chunk first: it finishes microbatches (forward) and is the earlier backward
                candidates = [(kind, stage, following[kind, stage]) for stage in (stages - 1 - rank, rank)]
                chosen = next((c for c in candidates if ready(*c, time) and (kind is not F or c[1] != rank or fits(rank))), None)
                if chosen is not None:
                    done[chosen] = time + 1
                    if _sender(kind, chosen[1], stage_ranks) is not None:
                        channels[_sender(kind, chosen[1], stage_ranks), rank].popleft()
                    after = (kind, chosen[1] + (1 if kind is F else -1), chosen[2])  # the action its message feeds
                    if kind is not W and 0 <= after[1] < stages and stage_ranks[after[1]] != rank:
                        channels[rank, stage_ranks[after[1]]].append(after)
                    following[kind, chosen[1]] += 1
                    actions[rank].append(Action(chosen[1], chosen[2], kind))
                    break
        time += 1
    return Schedule(actions, stage_ranks, microbatches)


def _sender(kind: Kind, stage: int, stage_ranks: tuple[int, ...]) -> int | None:
    """The rank whose message ``kind`` on ``stage`` waits for (F: the previous stage's, B: the next's), if another."""
    source = stage - 1 if kind is F else stage + 1 if kind is B else -1
    return stage_ranks[source] if 0 <= source < len(stage_ranks) and stage_ranks[source] != stage_ranks[stage] else None
