"""DualPipeV (DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv 2412.19437, §3.2.1: DualPipe, cut to one model copy).

DualPipe feeds microbatches from both ends so that a forward chunk of one microbatch overlaps a backward chunk of
another; DualPipeV (DeepSeek's DualPipe repository; torch's ``ScheduleDualPipeV``) folds both directions onto one
copy in the V of ``v_shape``: rank r of p holds stages r (chunk 0, down the ranks) and 2p - 1 - r (chunk 1, back
up). With ``below = p - 1 - r``, a rank runs 2·below chunk-0 forwards; r + 1 forwards of both chunks; below times
"B1 F1"; m - 2p + r + 1 times "F0 B1 F1 B0" (the overlapped pairs, forward then backward: our runtime runs one
action at a time); below times "B1 F1 B0"; r + 1 backwards of both chunks, the later half deferring their weight
gradients (``W``); below chunk-0 backwards, each after a deferred ``W``; the remaining ``W``'s. An undeferred
backward is ``B`` then its ``W``. One change: a chunk-0 forward moves after the chunk-1 backwards whose gradients
the next rank receives before its activation (ranks pair messages in order; DeepSeek's code defers those sends).
Needs microbatches >= 2p, one per stage, as DualPipeV does.
"""

from __future__ import annotations

from collections import Counter, deque

from lightning_nnscaler.schedules.actions import Action, Kind, Schedule

F, B, W = Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT


def dual_pipe_v(ranks: int, microbatches: int) -> Schedule:
    """Compute-only DualPipeV schedule: ``ranks`` ranks, 2 × ``ranks`` stages in a V.

    Raises:
        ValueError: naming ``ranks`` (not a positive integer) or ``microbatches`` (not an integer >= 2 × ranks).
    """
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise ValueError(f"dualpipev: ranks must be a positive integer, got {ranks!r}")
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 2 * ranks:
        raise ValueError(f"dualpipev: microbatches must be an integer >= 2 × ranks = {2 * ranks} (one per stage), got {microbatches!r}")
    programs = [_rank_program(rank, ranks, microbatches) for rank in range(ranks)]
    for rank in range(ranks - 2, -1, -1):  # rank + 1's order is final: send to it in the order it receives
        down, up = rank, 2 * ranks - 1 - rank
        received = [action.kind for action in programs[rank + 1] if (action.stage, action.kind) in ((down + 1, F), (up - 1, B))]
        gradients_before = [received[:index].count(B) for index, kind in enumerate(received) if kind is F]
        programs[rank] = _delay_forwards(programs[rank], down, up, gradients_before)
    return Schedule(programs, tuple(min(stage, 2 * ranks - 1 - stage) for stage in range(2 * ranks)), microbatches)


def _rank_program(rank: int, ranks: int, microbatches: int) -> list[Action]:
    """Rank ``rank``'s actions in DualPipeV's phases (the module docstring); tokens are kind and chunk."""
    chunks, below = (rank, 2 * ranks - 1 - rank), ranks - 1 - rank
    program: list[Action] = []
    issued: Counter = Counter()  # (stage, kind) -> how many microbatches it has run
    deferred: deque[Action] = deque()  # weight gradients put off, oldest first

    def run(kind: Kind, stage: int, defer: bool = False) -> None:
        microbatch, issued[stage, kind] = issued[stage, kind], issued[stage, kind] + 1
        program.append(Action(stage, microbatch, kind))
        if kind is B:
            (deferred if defer else program).append(Action(stage, microbatch, W))

    steady = microbatches - 2 * ranks + rank + 1
    for times, tokens in ((2 * below, "F0"), (rank + 1, "F0 F1"), (below, "B1 F1"), (steady, "F0 B1 F1 B0"), (below, "B1 F1 B0")):
        for _ in range(times):
            for token in tokens.split():
                run(Kind(token[0]), chunks[int(token[1])])
    half = (rank + 1) // 2  # from here on backwards defer W (odd ranks from chunk 1's, even ranks from chunk 0's)
    for step in range(rank + 1):
        run(B, chunks[1], defer=step > half or (step == half and rank % 2 == 1))
        run(B, chunks[0], defer=step >= half)
    for _ in range(below):
        program.append(deferred.popleft())
        run(B, chunks[0], defer=True)
    return program + list(deferred)


def _delay_forwards(program: list[Action], down: int, up: int, gradients_before: list[int]) -> list[Action]:
    """``program`` with each forward of ``down`` (microbatch i) no earlier than right after the
    ``gradients_before[i]``-th backward of ``up``."""
    result: list[Action] = []
    held: deque[Action] = deque()
    backwards = 0
    for action in program:
        if (action.stage, action.kind) == (down, F):
            held.append(action)
        else:
            result.append(action)
            backwards += (action.stage, action.kind) == (up, B)
        while held and gradients_before[held[0].microbatch] <= backwards:
            result.append(held.popleft())
    return result
