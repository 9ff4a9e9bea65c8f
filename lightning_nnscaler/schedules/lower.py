"""Lowering: compute-only per-rank lists → lists with the point-to-point communication they imply.

A forward of stage s > 0 needs its input from the rank holding s - 1, so ``RECV_F`` goes right
before it; a forward of a non-last stage ends with ``SEND_F`` to the rank holding s + 1. Backward
mirrors it with gradients: ``RECV_B`` from the rank holding s + 1 before B, ``SEND_B`` to the rank
holding s - 1 after it. Stages on the same rank hand tensors over in memory (no action). W needs
nothing. Each send sits where its producer ends and each receive where its consumer starts, so the
messages from one rank to another go in the sender's compute order and are received in the
receiver's compute order; ``validate`` checks that the two orders agree (activations and gradients
together), which is what lets gloo/NCCL pair the p2p operations in order. The generators here all pass.
"""

from __future__ import annotations

from lightning_nnscaler.schedules.actions import Action, Kind, Schedule


def lower(schedule: Schedule) -> Schedule:
    """Insert SEND/RECV actions around every compute action whose neighbour stage lives on another rank.

    Raises:
        ValueError: when ``schedule`` already holds communication actions (lowering twice would double them).
    """
    lowered = []
    for rank, rank_actions in enumerate(schedule.actions):
        rank_lowered: list[Action] = []
        for action in rank_actions:
            if not action.kind.is_compute:
                raise ValueError(f"lower() takes a compute-only schedule; rank {rank} already has {action}")
            before, after = communication_around(schedule, action, rank)
            rank_lowered += [*before, action, *after]
        lowered.append(rank_lowered)
    return Schedule(lowered, schedule.stage_ranks, schedule.microbatches, schedule.forward_only)


def communication_around(schedule: Schedule, action: Action, rank: int) -> tuple[list[Action], list[Action]]:
    """The receives that go right before ``action`` on ``rank`` and the sends that go right after it.

    A shared stage (run by every rank) meets its neighbour stages in memory, on the rank that holds
    the neighbour: its parts are brought together by collectives inside the stage, which every rank
    runs at the same point of its list (``plans.interlaced``), so no message crosses its boundary.
    """
    stage, microbatch = action.stage, action.microbatch
    before: list[Action] = []
    after: list[Action] = []

    def peers(neighbour: int) -> list[int]:
        if not 0 <= neighbour < schedule.stages:
            return []
        if schedule.is_shared(neighbour) or schedule.is_shared(stage):
            return []  # handed over in memory on the neighbour's rank
        return [peer for peer in schedule.holders(neighbour) if peer != rank]

    if action.kind is Kind.FORWARD:
        before += [Action(stage, microbatch, Kind.RECV_F, peer) for peer in peers(stage - 1)]
        after += [Action(stage, microbatch, Kind.SEND_F, peer) for peer in peers(stage + 1)]
    elif action.kind is Kind.BACKWARD:
        before += [Action(stage, microbatch, Kind.RECV_B, peer) for peer in peers(stage + 1)]
        if stage > 0 and schedule.has_backward(stage - 1):  # a forward-only stage takes no gradient
            after += [Action(stage, microbatch, Kind.SEND_B, peer) for peer in peers(stage - 1)]
    return before, after
