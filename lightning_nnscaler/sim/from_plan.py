"""A plan's per-rank task lists: what each rank runs in one training step, with durations.

The simulator runs the plan's ``program.Program``, the same actions the runtime dispatches
(``runtime.pipeline``), each priced: ``GATHER b<k>`` an all-gather of ZeRO bucket k; ``RECV_F``/``SEND_F``
the segment's boundary messages from/to that peer; ``F`` the segment's forward (its ops priced by the
compute model, its inline communication as tasks); ``RECV_B``/``B``/``SEND_B`` the segment's backward
(compute twice the work, a send becomes a receive of the gradient, a receive a send, a collective its
adjoint — ``runtime.autograd_comm``'s table; half the work when the program splits W off, which does
the other half); ``LOSS`` the loss sum (overlapping backward, or in a pipeline after the gradient sums,
as ``runtime.executor`` does); ``REDUCE b<k>`` bucket k's all-reduce (non-blocking) or ZeRO's
reduce-scatter, at the size the plan cut its buckets at; ``STEP`` the AdamW step over what the rank
steps; ``FREE`` nothing. Every task is labelled with its action's text (the prologue's ``prologue``), so
the simulated sequence can be held against the runtime's executed one, and a recorded timeline names it.
Activations (what autograd saves for backward, ``materialize.kept``, as ``explain`` counts them) are
added at F and freed at the last backward half. A boundary message's copy is released at the receive that
proves its peer took it (``materialize.releases``, as the generated ``RELEASES`` table does in the runtime).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from lightning_nnscaler.ir.tensor import dtype_bytes
from lightning_nnscaler.materialize.program import Assemble, Collective, Compute as ComputeAction, Program, Recv as RecvAction, Send as SendAction
from lightning_nnscaler.program import Action, ActionKind
from lightning_nnscaler.sim.costs import FLOATING, ComputeModel
from lightning_nnscaler.materialize.kept import KeptBytes, backward_seed_bytes
from lightning_nnscaler.materialize.posts import receive_posts
from lightning_nnscaler.materialize.releases import Message, pipeline_releases
from lightning_nnscaler.schedules.metrics import SPLIT_SHARE, WEIGHT_SHARE
from lightning_nnscaler.sim.tasks import Collective as CollectiveTask, Compute, Recv, Send, Task, WaitCollectives
from lightning_nnscaler.sim.transient import OpMemory, TransientBytes, backward_peaks

ADJOINT = {"all_reduce": "all_reduce", "all_gather": "reduce_scatter", "reduce_scatter": "all_gather", "all_to_all": "all_to_all", "broadcast": "all_reduce"}


@dataclass
class _Chunk:
    """Consecutive compute of one segment: forward and backward seconds, activation bytes kept."""

    forward: float = 0.0
    backward: float = 0.0
    recompute: float = 0.0
    """Forward seconds of its recomputed ops, run again by each backward pass (B, and W when split)."""
    kept: int = 0
    forward_peak: int = 0
    """Most bytes its forward holds beyond what was live before it (``sim.transient``)."""
    backward_peak: int = 0
    """Most bytes its backward holds beyond what was live before it, its kept bytes still counted."""
    junction: int = 0
    """Bytes of the output gradients of its ops that read both a trained parameter and an activation: a split
    backward's input half keeps them for its weight half (``runtime.split_backward``)."""
    ops: list[OpMemory] = field(default_factory=list)

    def gradient_vars(self) -> dict[str, int]:
        """Bytes of each trainable parameter piece's gradient its backward makes."""
        return {var: nbytes for op in self.ops for var, nbytes, parameter, _ in op.input_grads if parameter}


@dataclass
class _Segment:
    """One segment's items in order (chunks and inline communication) and its boundary messages."""

    items: list[Any] = field(default_factory=list)
    inputs: list[RecvAction] = field(default_factory=list)
    outputs: list[SendAction] = field(default_factory=list)

    @property
    def kept(self) -> int:
        return sum(item.kept for item in self.items if isinstance(item, _Chunk))

    @property
    def junction(self) -> int:
        """What a split backward's I keeps for its W: nothing in a segment without input gradients (W is then its whole backward)."""
        if not any(message.gradient for message in self.inputs):
            return 0
        return sum(item.junction for item in self.items if isinstance(item, _Chunk))


def _junction_bytes(action: ComputeAction, memory: OpMemory) -> int:
    """The bytes of ``action``'s outputs when its backward makes both a trained parameter's gradient and another input's."""
    kinds = {parameter for _, _, parameter, _ in memory.input_grads}
    if kinds != {True, False}:
        return 0
    return sum(output.nbytes for output in action.op.outputs)


class TaskBuilder:
    """Turns a plan's programs into ``sim.tasks`` lists, pricing ops with ``compute``.

    ``compute`` must give ``op_time(op)``, ``optimizer_seconds(tensor_numels)`` and ``copy_seconds(nbytes)``
    (``sim.model.DeviceModel`` does).
    """

    def __init__(self, plan: Any, compute: ComputeModel) -> None:
        self.plan, self.compute = plan, compute
        self.program: Program = plan.materialized
        self.message_bytes = {
            (action.src, rank_program.rank, action.tag): math.prod(action.shape) * dtype_bytes(action.dtype)
            for rank_program in self.program.ranks for action in rank_program.actions if isinstance(action, RecvAction)
        }
        self.element_bytes = {tensor.name: dtype_bytes(tensor.dtype) for tensor in plan.graph.parameters}
        self.trained = {tensor.name for tensor in plan.graph.parameters if tensor.requires_grad}
        self.posts = receive_posts(self.program)
        """Inline receives posted where their message is sent (``materialize.posts``): no late receive."""
        self.releases = pipeline_releases(self.program, plan.program) if self.program.pipelined else None
        """Per rank, which sent messages each received one proves taken (the runtime's ``RELEASES``)."""
        self._made: set[str] = set()
        """Parameter pieces whose gradients exist so far in the rank's step being built."""

    def _trains(self, name: str) -> bool:
        return name in self.trained

    def lists(self) -> list[list[Task]]:
        """Every rank's tasks for one training step."""
        return [self.rank_tasks(rank) for rank in range(self.program.world_size)]

    def rank_tasks(self, rank: int) -> list[Task]:
        """Rank ``rank``'s tasks: the prologue, then each action of its program (see the module docstring)."""
        segments = self._segments(rank)
        self._made = set(self._bucketed(rank))  # gradients held all along: the reducer's buckets
        actions = self.plan.program.actions[rank]
        self._split = any(action.kind is ActionKind.WEIGHT for action in actions)
        self._backward_stages = {action.stage for action in actions if action.kind is ActionKind.BACKWARD}
        self._seeds = backward_seed_bytes(self.program, rank)
        self._waited = False
        tasks: list[Task] = []
        for key, segment in segments.items():
            if key is not None and key[0] < 0:  # the prologue, once, without gradients
                tasks += self._forward(segment, rank, keep=False, label="prologue")
        for action in actions:
            segment = segments.get(self._segment_key(action), _Segment()) if action.kind.is_segment else _Segment()
            tasks += self._action_tasks(action, segment, rank)
        return tasks

    def _segment_key(self, action: Action) -> tuple[int, int] | None:
        """The materialized program's segment of ``action``: None in a plan that is not pipelined."""
        return (action.stage, action.microbatch) if self.program.pipelined else None

    def _action_tasks(self, action: Action, segment: _Segment, rank: int) -> list[Task]:
        """The tasks of one action."""
        kind, label = action.kind, str(action)
        if kind is ActionKind.RECV_F:
            return [Recv(message.src, label, self._released(rank, Message(message.src, rank, message.tag, False)),
                         (message.src, rank, message.tag) in self.posts) for message in segment.inputs if message.src == action.peer]
        if kind is ActionKind.FORWARD:
            return self._forward(segment, rank, keep=action.stage in self._backward_stages, label=label)
        if kind is ActionKind.SEND_F:
            return [Send(message.dst, self.message_bytes.get((rank, message.dst, message.tag), 0), label)
                    for message in segment.outputs if message.dst == action.peer]
        if kind is ActionKind.RECV_B:
            return [Recv(message.dst, label, self._released(rank, Message(message.dst, rank, message.tag, True)))
                    for message in segment.outputs if message.dst == action.peer and message.gradient]
        if kind is ActionKind.BACKWARD:
            return self._backward_action(action, segment, rank)
        if kind is ActionKind.SEND_B:
            return [Send(message.src, self.message_bytes.get((message.src, rank, message.tag), 0), label)
                    for message in segment.inputs if message.src == action.peer and message.gradient]
        if kind is ActionKind.WEIGHT:
            chunks = [item for item in segment.items if isinstance(item, _Chunk)]
            seed = self._seeds.get((action.stage, action.microbatch), 0)
            return [Compute(sum(item.backward * WEIGHT_SHARE + item.recompute for item in chunks), "weight", label,
                            activation_bytes=-(segment.kept + seed), held_bytes=-segment.junction)]
        return self._step_tasks(action, rank)

    def _backward_action(self, action: Action, segment: _Segment, rank: int) -> list[Task]:
        """B: the segment's backward, holding its loss seeds while it runs (until W when the program splits W off)."""
        label = str(action)
        if not self.program.pipelined:
            return self._backward(segment, rank, SPLIT_SHARE if self._split else 1.0, release=not self._split, label=label)
        seed = self._seeds.get((action.stage, action.microbatch), 0)
        tasks: list[Task] = [Compute(0.0, "backward", label, activation_bytes=seed)]
        tasks += self._backward(segment, rank, SPLIT_SHARE if self._split else 1.0, release=not self._split, label=label)
        if self._split:
            return tasks + [Compute(0.0, "backward", label, held_bytes=segment.junction)]
        return tasks + [Compute(0.0, "backward", label, activation_bytes=-seed)]

    def _step_tasks(self, action: Action, rank: int) -> list[Task]:
        """LOSS, REDUCE, GATHER, FREE and STEP (see the module docstring)."""
        kind, label = action.kind, str(action)
        everyone = tuple(range(self.program.world_size))
        if kind is ActionKind.LOSS:
            if not self.program.pipelined:
                return [CollectiveTask("all_reduce", everyone, 8, label, blocking=False)]
            self._waited = True
            return [WaitCollectives(label), CollectiveTask("all_reduce", everyone, 8, label)]
        bucket = self.plan.program.buckets[rank][action.bucket] if action.bucket is not None else None
        if kind is ActionKind.REDUCE:
            if self.plan.program.zero_stage:
                return [CollectiveTask("reduce_scatter", tuple(sorted(bucket.ranks)), bucket.nbytes, label)]
            return [CollectiveTask("all_reduce", tuple(sorted(bucket.ranks)), bucket.nbytes, label, blocking=False)]
        if kind is ActionKind.GATHER:
            return [CollectiveTask("all_gather", tuple(sorted(bucket.ranks)), bucket.nbytes, label)]
        if kind is ActionKind.FREE:
            return [Compute(0.0, "other", label)]
        waits = [] if self._waited else [WaitCollectives(label)]
        return [*waits, Compute(self.compute.optimizer_seconds(self._stepped(rank)), "optimizer", label)]

    # --- programs into segments ----------------------------------------------------------------------

    def _segments(self, rank: int) -> dict[Any, _Segment]:
        segments: dict[Any, _Segment] = {}
        kept = KeptBytes(self.program.ranks[rank], self._trains)
        transient = TransientBytes(self.program.ranks[rank], kept)
        for action in self.program.ranks[rank].actions:
            segment = segments.setdefault(action.segment, _Segment())
            kept.follow(action)
            if not isinstance(action, ComputeAction):
                transient.follow(action)  # a compute is followed once KeptBytes found which outputs view inputs
            if isinstance(action, ComputeAction):
                chunk = segment.items[-1] if segment.items and isinstance(segment.items[-1], _Chunk) else None
                if chunk is None:
                    chunk = _Chunk()
                    segment.items.append(chunk)
                time = self.compute.op_time(action.op)
                recomputed = action.op.recompute is not None
                chunk.forward += time.forward
                chunk.backward += time.backward
                chunk.recompute += time.forward if recomputed and time.backward else 0.0
                op_kept = kept.kept(action)
                transient.follow(action)
                chunk.kept += op_kept
                chunk.forward_peak = max(chunk.forward_peak, chunk.kept + transient.forward_bytes(action))
                memory = transient.op_memory(action, op_kept)
                chunk.ops.append(memory)
                chunk.junction += _junction_bytes(action, memory)
            elif isinstance(action, Assemble):
                nbytes = action.piece.nbytes
                segment.items.append(_Chunk(self.compute.copy_seconds(nbytes), self.compute.copy_seconds(nbytes)))
            elif isinstance(action, SendAction) and action.boundary:
                segment.outputs.append(action)
            elif isinstance(action, RecvAction) and action.boundary:
                segment.inputs.append(action)
            else:
                segment.items.append(action)
        for segment in segments.values():
            chunks = [item for item in segment.items if isinstance(item, _Chunk)]
            for chunk, peak in zip(chunks, backward_peaks([chunk.ops for chunk in chunks]), strict=True):
                chunk.backward_peak = peak
        return segments

    # --- forward and backward of one segment -----------------------------------------------------------

    def _forward(self, segment: _Segment, rank: int, keep: bool = True, label: str = "") -> list[Task]:
        tasks: list[Task] = []
        for item in segment.items:
            if isinstance(item, _Chunk):
                tasks.append(Compute(item.forward, "forward", label, activation_bytes=item.kept if keep else 0, transient_bytes=item.forward_peak))
            elif isinstance(item, SendAction):
                tasks.append(Send(item.dst, self.message_bytes.get((rank, item.dst, item.tag), 0), label))
            elif isinstance(item, RecvAction):
                tasks.append(Recv(item.src, label, posted=(item.src, rank, item.tag) in self.posts))
            elif isinstance(item, Collective):
                tasks.append(CollectiveTask(item.kind, tuple(sorted(item.ranks)), item.bytes_per_device, label))
        return tasks

    def _bucketed(self, rank: int) -> list[str]:
        """The rank's parameter pieces whose gradients live in the reducer's buckets (replicated, no ZeRO), not made by backward."""
        if self.plan.zero_stage:
            return []
        replicated = {group.name for group in self.program.gradient_groups if rank in group.ranks and len(group.ranks) > 1}
        return [local.var for local in self.program.ranks[rank].inputs if local.role == "parameter" and local.name in replicated]

    def _new_gradients(self, chunk: _Chunk) -> int:
        """Bytes of the gradients ``chunk``'s backward makes that no earlier backward of the step made (they live on)."""
        fresh = {var: nbytes for var, nbytes in chunk.gradient_vars().items() if var not in self._made}
        self._made.update(fresh)
        return sum(fresh.values())

    def _backward(self, segment: _Segment, rank: int, share: float, release: bool = True, label: str = "") -> list[Task]:
        tasks: list[Task] = []
        for item in reversed(segment.items):
            if isinstance(item, _Chunk):
                if item.backward:
                    tasks.append(Compute(item.backward * share + item.recompute, "backward", label, activation_bytes=-item.kept if release else 0,
                                         transient_bytes=item.backward_peak, gradient_bytes=self._new_gradients(item)))
                elif release and item.kept:
                    tasks.append(Compute(0.0, "backward", label, activation_bytes=-item.kept))
            elif isinstance(item, SendAction) and self._floating_message(rank, item.dst, item.tag):
                tasks.append(Recv(item.dst, label))
            elif isinstance(item, RecvAction) and item.dtype in FLOATING:
                tasks.append(Send(item.src, self.message_bytes.get((item.src, rank, item.tag), 0), label))
            elif isinstance(item, Collective):
                tasks.append(CollectiveTask(ADJOINT.get(item.kind, item.kind), tuple(sorted(item.ranks)), item.bytes_per_device, label))
        return tasks

    def _floating_message(self, src: int, dst: int, tag: int) -> bool:
        receiver = self.program.ranks[dst]
        return any(isinstance(action, RecvAction) and action.src == src and action.tag == tag and action.dtype in FLOATING for action in receiver.actions)

    def _released(self, rank: int, received: Message) -> int:
        """Bytes of the messages ``rank`` sent whose copies it drops on receiving ``received`` (``materialize.releases``)."""
        released = self.releases[rank].get(received, ()) if self.releases else ()
        return sum(self._message_bytes(message) for message in released)

    def _message_bytes(self, message: Message) -> int:
        """Bytes of a boundary message: a gradient has its activation's (which went the other way)."""
        if message.gradient:
            return self.message_bytes.get((message.dst, message.src, message.tag), 0)
        return self.message_bytes.get((message.src, message.dst, message.tag), 0)

    # --- gradient reduction and the optimizer step -------------------------------------------------------

    def _stepped(self, rank: int) -> list[int]:
        """Element counts of the tensors rank's optimizer steps (its boxes, or its chunks of replicated ones under ZeRO)."""
        replicated = {(group.name, group.box): len(group.ranks) for group in self.program.gradient_groups if rank in group.ranks}
        numels = []
        for local in self.program.ranks[rank].inputs:
            replicas = replicated.get((local.name, local.box))
            if local.role != "parameter" or replicas is None:
                continue
            numel = math.prod(stop - start for start, stop in local.box)
            numels.append(math.ceil(numel / replicas) if self.plan.zero_stage and replicas > 1 else numel)
        return numels


def plan_task_lists(plan: Any, compute: ComputeModel) -> list[list[Task]]:
    """Every rank's tasks for one training step of ``plan`` (see the module docstring)."""
    return TaskBuilder(plan, compute).lists()
