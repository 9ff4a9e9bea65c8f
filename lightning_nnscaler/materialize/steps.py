"""From a materialized program to the step's ``program.Program``: its messages between segments and its buckets.

``step_program`` lowers each rank's compute actions (a pipeline's schedule, or ``0F0 0B0``) with the
passes of ``program.lower``: the peers of each segment come from the boundary messages materialization
made, the buckets from the gradient groups (``program.buckets``, indices into the rank's
``GRADIENT_GROUPS`` table, the order codegen writes it in). ``check_message_order`` holds every pair of
ranks' messages, in the order the program posts them, to NCCL's rule (pairs in posting order).
"""

from __future__ import annotations

import math

from collections.abc import Mapping, Sequence

from lightning_nnscaler.ir.box import Box
from lightning_nnscaler.ir.tensor import dtype_bytes
from lightning_nnscaler.ir.validate import PlanError
from lightning_nnscaler.materialize.program import Compute, GradientGroup, Program as Materialized, RankProgram, Recv, Send
from lightning_nnscaler.program import WHOLE_STEP_ACTIONS, Action, ActionKind, Bucket, Program, ReplicatedBox, SegmentPeers, gradient_buckets, lower_step


def rank_gradient_groups(materialized: Materialized) -> list[list[GradientGroup]]:
    """Per rank, the groups it sums with other ranks, in the program's order (each rank's ``GRADIENT_GROUPS``)."""
    per_rank: list[list[GradientGroup]] = [[] for _ in range(materialized.world_size)]
    for group in materialized.gradient_groups:
        if len(group.ranks) > 1:
            for rank in group.ranks:
                per_rank[rank].append(group)
    return per_rank


def rank_buckets(
    groups: Sequence[GradientGroup], dtypes: Mapping[str, str], bucket_bytes: int, zero: bool,
    stages: Mapping[tuple[str, Box], int] | None = None,
) -> tuple[Bucket, ...]:
    """A rank's buckets over its ``groups`` (``rank_gradient_groups``); a bucket's vars are indices into ``groups``.
    ``stages``: the one pipeline stage reading each ``(tensor name, box)``, for buckets of one stage's boxes (ZeRO-3)."""
    boxes = [ReplicatedBox(str(index), tuple(group.ranks), math.prod(stop - start for start, stop in group.box), dtype_bytes(dtypes.get(group.name, "float32")),
                           dtypes.get(group.name, "float32"), (stages or {}).get((group.name, group.box)))
             for index, group in enumerate(groups)]
    return gradient_buckets(boxes, bucket_bytes, zero=zero)


def box_stages(rank_program: RankProgram) -> dict[tuple[str, Box], int]:
    """The pipeline stage of each parameter box the rank holds that the segments of one stage alone read."""
    var_stages: dict[str, set[int]] = {}
    for action in rank_program.actions:
        if isinstance(action, Compute) and action.segment is not None:
            for var in action.input_vars:
                var_stages.setdefault(var, set()).add(action.segment[0])
    return {(local.name, local.box): next(iter(var_stages[local.var])) for local in rank_program.inputs
            if local.role == "parameter" and len(var_stages.get(local.var, ())) == 1 and next(iter(var_stages[local.var])) >= 0}


def segment_peers(rank_program: RankProgram) -> dict[tuple[int, int], SegmentPeers]:
    """Each segment's peers (``program.SegmentPeers``) from the rank's boundary messages, this rank itself left out."""
    found: dict[tuple[int, int], dict[str, list[int]]] = {}
    rank = rank_program.rank
    for action in rank_program.actions:
        if not isinstance(action, (Send, Recv)) or not action.boundary or action.segment is None:
            continue
        peer = action.src if isinstance(action, Recv) else action.dst
        if peer == rank:
            continue
        lists = found.setdefault(action.segment, {"inputs": [], "outputs": [], "gradient_inputs": [], "gradient_outputs": []})
        names = ("inputs", "gradient_inputs") if isinstance(action, Recv) else ("outputs", "gradient_outputs")
        for name in names[: 2 if action.gradient else 1]:
            if peer not in lists[name]:
                lists[name].append(peer)
    return {segment: SegmentPeers(**{name: tuple(peers) for name, peers in lists.items()}) for segment, lists in found.items()}


def step_program(
    materialized: Materialized, lists: Sequence[Sequence[Action]] | None, dtypes: Mapping[str, str], *, zero_stage: int = 0,
    bucket_bytes: int,
) -> Program:
    """The step's program: ``lists`` are the ranks' compute actions (None: not pipelined, ``WHOLE_STEP_ACTIONS``).

    Raises:
        PlanError: ZeRO over a schedule of several microbatches where a rank runs several stages (``refuse_zero``).
    """
    world_size = materialized.world_size
    if zero_stage and lists is not None:
        refuse_zero(lists, zero_stage)
    groups = rank_gradient_groups(materialized)
    staged = zero_stage == 3 and lists is not None  # ZeRO-3 over a plan cut into stages: one stage's boxes per bucket
    buckets = [rank_buckets(groups[rank], dtypes, bucket_bytes, bool(zero_stage), box_stages(materialized.ranks[rank]) if staged else None)
               for rank in range(world_size)]
    peers = [segment_peers(rank_program) for rank_program in materialized.ranks]
    compute = [WHOLE_STEP_ACTIONS] * world_size if lists is None else lists
    return lower_step(compute, lambda rank, segment: peers[rank].get(segment, SegmentPeers()), buckets,
                      pipelined=lists is not None, zero_stage=zero_stage, bucket_bytes=bucket_bytes)


def refuse_zero(lists: Sequence[Sequence[Action]], zero_stage: int) -> None:
    """Raise ``PlanError`` for ZeRO over a schedule of several microbatches in which a rank runs several stages.

    With one stage per rank (gpipe, 1f1b, zb1, hybrid3d) a rank's boxes accumulate their gradients over every
    microbatch and are reduce-scattered once, after its last backward, and (ZeRO-3) stay gathered from its first
    forward to then. With several stages per rank and microbatches, a stage's window would close and open again
    between its backwards (dropping the gradient it accumulated), and a box summed over ranks that run it in other
    stages would be gathered or reduce-scattered by one rank while the other waits for its messages.
    """
    microbatches = any(action.microbatch for rank_actions in lists for action in rank_actions)
    several = [rank for rank, rank_actions in enumerate(lists) if len({action.stage for action in rank_actions}) > 1]
    if microbatches and several:
        raise PlanError(
            f"ZeRO stage {zero_stage} with several microbatches per step on a schedule where rank {several[0]} runs several "
            "stages (interleaved, the V-shapes, 3f1b, interlaced, or a schedule_csv of such): a stage's gradients would be "
            "reduce-scattered or its parameters freed between its microbatches; use a recipe of one stage per rank with "
            "zero= (1f1b, gpipe, zb1, hybrid3d), or zero3's stages (one microbatch)"
        )


def check_message_order(materialized: Materialized, steps: Program) -> None:
    """Raise ``PlanError`` unless, between every two ranks, the point-to-point messages are received in the
    order they are sent when each rank runs its actions in ``steps``: NCCL pairs point-to-point messages in
    posting order and ignores tags. Every message counts: the boundary messages at the program's
    RECV/SEND actions, and the messages inside a segment (its forward in program order, the gradients of
    the floating ones in reverse in its backward).

    A rank-local ``materialized`` (``local_rank``) holds whole only the channels of its rank: those are checked
    (every rank checks its own, so a job's ranks together check every pair)."""
    sent: dict[tuple[int, int], list[tuple[str, int]]] = {}
    received: dict[tuple[int, int], list[tuple[str, int]]] = {}
    floating = {(action.src, rank_program.rank, action.tag): action.dtype.startswith(("float", "bfloat", "complex"))
                for rank_program in materialized.ranks for action in rank_program.actions if isinstance(action, Recv)}
    local = materialized.local_rank
    for rank_program in materialized.ranks:
        rank = rank_program.rank
        for kind, src, dst, tag in _posted_messages(rank_program, steps.actions[rank], floating):
            if local is None or local in (src, dst):
                (sent if src == rank else received).setdefault((src, dst), []).append((kind, tag))
    for (src, dst), messages in sorted(sent.items()):
        got = received.get((src, dst), [])
        if src != dst and messages != got:
            index = next((i for i, (a, b) in enumerate(zip(messages, got)) if a != b), min(len(messages), len(got)))
            raise PlanError(
                f"rank {src} sends rank {dst} its messages in another order than rank {dst} receives them: "
                f"message {index} is {messages[index] if index < len(messages) else 'none'} on rank {src} but "
                f"{got[index] if index < len(got) else 'none'} on rank {dst} (kind, tag); NCCL would pair them wrongly. "
                "Reorder the schedule, or cut the stages so that no tensor skips a stage."
            )


def _posted_messages(
    rank_program: RankProgram, actions: Sequence[Action], floating: Mapping[tuple[int, int, int], bool],
) -> list[tuple[str, int, int, int]]:
    """``(kind, sender, receiver, tag)`` of every message one rank posts, in the order its actions post them."""
    rank = rank_program.rank
    boundary_in: dict[tuple, list[Recv]] = {}
    boundary_out: dict[tuple, list[Send]] = {}
    inline: dict[tuple, list[Send | Recv]] = {}
    for action in rank_program.actions:
        if isinstance(action, (Send, Recv)):
            table = (boundary_in if isinstance(action, Recv) else boundary_out) if action.boundary else inline
            table.setdefault(action.segment, []).append(action)
    posted: list[tuple[str, int, int, int]] = []
    for action in actions:
        segment, peer, kind = (action.stage, action.microbatch), action.peer, action.kind
        if kind is ActionKind.RECV_F:
            posted += [("activation", peer, rank, message.tag) for message in boundary_in.get(segment, []) if message.src == peer]
        elif kind is ActionKind.SEND_F:
            posted += [("activation", rank, peer, message.tag) for message in boundary_out.get(segment, []) if message.dst == peer]
        elif kind is ActionKind.RECV_B:
            posted += [("gradient", peer, rank, message.tag) for message in boundary_out.get(segment, []) if message.dst == peer and message.gradient]
        elif kind is ActionKind.SEND_B:
            posted += [("gradient", rank, peer, message.tag) for message in boundary_in.get(segment, []) if message.src == peer and message.gradient]
        elif kind is ActionKind.FORWARD:
            posted += [("inline", rank, message.dst, message.tag) if isinstance(message, Send) else ("inline", message.src, rank, message.tag)
                       for message in inline.get(segment, [])]
        elif kind is ActionKind.BACKWARD:
            for message in reversed(inline.get(segment, [])):
                channel = (rank, message.dst, message.tag) if isinstance(message, Send) else (message.src, rank, message.tag)
                if floating.get(channel, False):  # the gradient goes the other way
                    posted.append(("inline gradient", channel[1], channel[0], message.tag))
    return posted
