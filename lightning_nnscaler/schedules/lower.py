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
            before, after = communication_around(schedule, action)
            rank_lowered += [*before, action, *after]
        lowered.append(rank_lowered)
    return Schedule(lowered, schedule.stage_ranks, schedule.microbatches, schedule.forward_only)


def communication_around(schedule: Schedule, action: Action) -> tuple[list[Action], list[Action]]:
    """The receives that go right before ``action`` and the sends that go right after it."""
    rank = schedule.stage_ranks[action.stage]
    previous_rank = schedule.stage_ranks[action.stage - 1] if action.stage > 0 else rank
    next_rank = schedule.stage_ranks[action.stage + 1] if action.stage + 1 < schedule.stages else rank
    before: list[Action] = []
    after: list[Action] = []
    if action.kind is Kind.FORWARD:
        if previous_rank != rank:
            before.append(Action(action.stage, action.microbatch, Kind.RECV_F, previous_rank))
        if next_rank != rank:
            after.append(Action(action.stage, action.microbatch, Kind.SEND_F, next_rank))
    elif action.kind is Kind.BACKWARD:
        if next_rank != rank:
            before.append(Action(action.stage, action.microbatch, Kind.RECV_B, next_rank))
        if previous_rank != rank and schedule.has_backward(action.stage - 1):  # a forward-only stage takes no gradient
            after.append(Action(action.stage, action.microbatch, Kind.SEND_B, previous_rank))
    return before, after
