"""Lowering: a schedule's compute actions → the step's whole ``Program``, one short pass at a time.

Each pass takes a ``Program`` and returns a new one, and each is tested alone on literal text:

- ``compute_only``: the ranks' F/B/W lists (a pipeline's schedule, or ``0F0 0B0`` for a plan that is
  not pipelined) with the step's gradient buckets;
- ``with_messages``: the messages between segments that materialization found, around the compute
  actions that post them: ``RECV_F`` from each rank a segment's inputs come from before its F and
  ``SEND_F`` to each rank its outputs go to after it; ``RECV_B`` before B for each rank that sends
  the gradients of its outputs back, ``SEND_B`` after it for each rank that gets its input gradients;
- ``with_reductions``: ``REDUCE`` of every bucket right after the rank's last action that accumulates
  parameter gradients (the last W, or B): the buckets start while that action runs, as each fills; under
  ZeRO (a blocking reduce-scatter) after the ``SEND_B`` that follow it, which a peer in the bucket may wait for;
- ``with_loss``: ``LOSS`` right after the last forward (and its sends) where the sum may overlap the
  backward (a plan that is not pipelined), else at the end: a collective in flight beside a
  pipeline's point-to-point messages could be ordered differently on each rank (NCCL);
- ``with_optimizer``: ``STEP``, and ZeRO's gathers: stage 1 gathers every bucket's boxes after ``STEP``;
  stage 3 gathers a bucket before its boxes are used and frees it after: a bucket of one pipeline stage's
  boxes around each run of that stage's compute actions (so a plan cut into stages holds one stage's
  boxes at a time, as FSDP gathers per layer), any other bucket from the step's first action to ``STEP``;
  a gather goes before the ``RECV_F`` of the action it precedes. A pipeline of one stage per rank and several
  microbatches (1f1b, hybrid3d with ``zero=3``) thus gathers its stage before its first forward and frees it
  after its ``REDUCE``: the gradients accumulate over the microbatches in the full-size boxes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_nnscaler.program.actions import Action, ActionKind
from lightning_nnscaler.program.buckets import BUCKET_BYTES, Bucket
from lightning_nnscaler.program.program import Program

Segment = tuple[int, int]

WHOLE_STEP_ACTIONS = (Action(0, 0, ActionKind.FORWARD), Action(0, 0, ActionKind.BACKWARD))
"""The compute of a plan that is not pipelined: its one segment's forward, then its backward."""


@dataclass(frozen=True)
class SegmentPeers:
    """The other ranks one segment exchanges messages with, each once, in the order of its first message.

    Attributes:
        inputs: ranks its input activations come from.
        outputs: ranks its output activations go to.
        gradient_inputs: ranks its input gradients go back to (its floating inputs' senders).
        gradient_outputs: ranks its output gradients come back from.
    """

    inputs: tuple[int, ...] = ()
    outputs: tuple[int, ...] = ()
    gradient_inputs: tuple[int, ...] = ()
    gradient_outputs: tuple[int, ...] = ()


def compute_only(
    lists: Sequence[Sequence[Action]], buckets: Sequence[Sequence[Bucket]] = (), *, zero_stage: int = 0, bucket_bytes: int = BUCKET_BYTES,
) -> Program:
    """The program of the ranks' compute actions alone, with their buckets.

    Raises:
        ValueError: a list holds an action that is not F, B or W.
    """
    for rank, rank_actions in enumerate(lists):
        for action in rank_actions:
            if not action.kind.is_compute:
                raise ValueError(f"compute_only() takes F, B and W actions; rank {rank} has {action}")
    return Program(tuple(tuple(rank_actions) for rank_actions in lists), tuple(buckets), zero_stage, bucket_bytes)


def with_messages(program: Program, peers: Callable[[int, Segment], SegmentPeers]) -> Program:
    """Insert each segment's messages around its F and B (see the module docstring); ``peers(rank, segment)``."""
    lowered = []
    for rank, rank_actions in enumerate(program.actions):
        rank_lowered: list[Action] = []
        for action in rank_actions:
            segment = peers(rank, (action.stage, action.microbatch)) if action.kind.is_compute else SegmentPeers()
            stage, microbatch = action.stage, action.microbatch
            if action.kind is ActionKind.FORWARD:
                rank_lowered += [Action(stage, microbatch, ActionKind.RECV_F, peer) for peer in segment.inputs]
                rank_lowered.append(action)
                rank_lowered += [Action(stage, microbatch, ActionKind.SEND_F, peer) for peer in segment.outputs]
            elif action.kind is ActionKind.BACKWARD:
                rank_lowered += [Action(stage, microbatch, ActionKind.RECV_B, peer) for peer in segment.gradient_outputs]
                rank_lowered.append(action)
                rank_lowered += [Action(stage, microbatch, ActionKind.SEND_B, peer) for peer in segment.gradient_inputs]
            else:
                rank_lowered.append(action)
        lowered.append(rank_lowered)
    return program.replace_actions(lowered)


def with_reductions(program: Program) -> Program:
    """``REDUCE`` of each of a rank's buckets right after its last gradient-accumulating action; under ZeRO-3, a bucket
    of one stage's boxes right after that stage's last one (its gradients are complete there, and its boxes can go).
    The buckets are numbered in the order their ``REDUCE`` runs."""
    lowered, renumbered = [], []
    for rank, rank_actions in enumerate(program.actions):
        buckets = program.buckets[rank]
        last = last_accumulating(rank_actions)
        if last is None or not buckets:
            lowered.append(list(rank_actions))
            renumbered.append(buckets)
            continue
        staged = program.zero_stage == 3
        after = [_last_of_stage(rank_actions, bucket.stage, last) if staged else last for bucket in buckets]
        if program.zero_stage:  # a blocking reduce-scatter: after the gradients this action sends back, which a peer may wait for
            after = [_after_sends(rank_actions, position) for position in after]
        order = sorted(range(len(buckets)), key=lambda index: (after[index], index))
        renumbered.append(tuple(buckets[index] for index in order))
        actions: list[Action] = []
        for position, action in enumerate(rank_actions):
            actions.append(action)
            actions += [Action.step(ActionKind.REDUCE, new) for new, old in enumerate(order) if after[old] == position]
        lowered.append(actions)
    return Program(tuple(tuple(rank) for rank in lowered), tuple(renumbered), program.zero_stage, program.bucket_bytes)


def _last_of_stage(actions: Sequence[Action], stage: int | None, last: int) -> int:
    """The index of ``stage``'s last gradient-accumulating action (``last``, the rank's, for a bucket of no one stage)."""
    if stage is None:
        return last
    kind = actions[last].kind
    return max((index for index, action in enumerate(actions) if action.kind is kind and action.stage == stage), default=last)


def _after_sends(actions: Sequence[Action], position: int) -> int:
    """The index of the last ``SEND_B`` right after ``position`` (``position`` itself when none follows it)."""
    while position + 1 < len(actions) and actions[position + 1].kind is ActionKind.SEND_B:
        position += 1
    return position


def last_accumulating(actions: Sequence[Action]) -> int | None:
    """The index of the last action that accumulates parameter gradients: the last W, or without W the last B."""
    kind = ActionKind.WEIGHT if any(action.kind is ActionKind.WEIGHT for action in actions) else ActionKind.BACKWARD
    return max((index for index, action in enumerate(actions) if action.kind is kind), default=None)


def with_loss(program: Program, *, overlapped: bool) -> Program:
    """``LOSS`` after the last forward and its sends when ``overlapped``, else at the end of every rank's list."""
    lowered = []
    for rank_actions in program.actions:
        actions = list(rank_actions)
        if not overlapped:
            lowered.append([*actions, Action.step(ActionKind.LOSS)])
            continue
        last_forward = max((index for index, action in enumerate(actions) if action.kind is ActionKind.FORWARD), default=None)
        after = 0 if last_forward is None else last_forward + 1
        while last_forward is not None and after < len(actions) and actions[after].kind is ActionKind.SEND_F:
            after += 1
        lowered.append([*actions[:after], Action.step(ActionKind.LOSS), *actions[after:]])
    return program.replace_actions(lowered)


def with_optimizer(program: Program) -> Program:
    """``STEP`` at the end of every rank's list, with ZeRO's gathers and frees around the step (module docstring)."""
    lowered = []
    for rank, rank_actions in enumerate(program.actions):
        buckets = program.buckets[rank]
        gathers = [Action.step(ActionKind.GATHER, index) for index in range(len(buckets))]
        step = [Action.step(ActionKind.STEP)]
        if program.zero_stage == 3:
            lowered.append(_zero3_windows(list(rank_actions), buckets) + step + [
                Action.step(ActionKind.FREE, index) for index, bucket in enumerate(buckets) if bucket.stage is None])
        elif program.zero_stage == 1:
            lowered.append([*rank_actions, *step, *gathers])
        else:
            lowered.append([*rank_actions, *step])
    return program.replace_actions(lowered)


def _zero3_windows(actions: list[Action], buckets: Sequence[Bucket]) -> list[Action]:
    """ZeRO-3's gathers: a bucket of no one stage's boxes before the first action, held to the end; a stage's buckets
    gathered before each run of that stage's compute actions and freed after it (after their REDUCE, at the last)."""
    by_stage: dict[int, list[int]] = {}
    for index, bucket in enumerate(buckets):
        if bucket.stage is not None:
            by_stage.setdefault(bucket.stage, []).append(index)
    result = [Action.step(ActionKind.GATHER, index) for index, bucket in enumerate(buckets) if bucket.stage is None]
    held: int | None = None  # the stage whose buckets are gathered now
    for action in actions:
        if action.kind.is_compute and action.stage != held:
            receives = 0  # the RECV_F of this action: a gather (a collective) goes before them, as a peer may gather first
            while receives < len(result) and result[len(result) - 1 - receives].kind is ActionKind.RECV_F:
                receives += 1
            window = [Action.step(ActionKind.FREE, index) for index in by_stage.get(held, ())]
            held = action.stage
            window += [Action.step(ActionKind.GATHER, index) for index in by_stage.get(held, ())]
            result[len(result) - receives:len(result) - receives] = window
        result.append(action)
    return result + [Action.step(ActionKind.FREE, index) for index in by_stage.get(held, ())]


def lower_step(
    lists: Sequence[Sequence[Action]], peers: Callable[[int, Segment], SegmentPeers], buckets: Sequence[Sequence[Bucket]], *,
    pipelined: bool, zero_stage: int = 0, bucket_bytes: int = BUCKET_BYTES,
) -> Program:
    """The whole step: every pass above, in order (a pipeline sums its loss at the end, after its buckets)."""
    program = compute_only(lists, buckets, zero_stage=zero_stage, bucket_bytes=bucket_bytes)
    program = with_messages(program, peers)
    program = with_reductions(program)
    program = with_loss(program, overlapped=not pipelined)
    return with_optimizer(program)
