"""A plan's per-rank task lists: what each rank runs in one training step, with durations.

Non-pipelined plans: the rank's program in order (forward), then its transpose in reverse
(backward: compute twice the work, a send becomes a receive of the gradient, a receive a send, a
collective its adjoint — ``runtime.autograd_comm``'s table), then the gradient reduction
(``runtime.reducer``: stage 0 all-reduces buckets of ``BUCKET_BYTES`` per ranks tuple; ZeRO
reduce-scatters buckets of the replicated boxes and all-gathers them, stage 1 after the optimizer
step, stage 3 before the forward), the AdamW step over what the rank steps, and the loss sum (with the
gradients; a pipeline sums it after them, as ``runtime.executor`` does).

Pipelined plans run the schedule's actions (``PipelinePlan.actions(rank)``) as ``runtime.pipeline``
does: the prologue once, then per ``F(s, m)`` the boundary receives, the segment's forward and
the boundary sends; per ``B`` the gradient receives, the segment's backward (half of it, the input
gradients, when the schedule splits W off), the gradient sends; ``W`` the whole backward again
(``runtime.pipeline``'s W differentiates B's kept root for the weights, which walks the input-gradient
chain once more to reach them: a zero-bubble step computes 1.5 backwards). Activations (what autograd saves
for backward, ``materialize.kept``, as ``explain`` counts them) are added at F and freed at
the last backward half. A boundary message's copy is released at the receive that proves its peer took it
(``materialize.releases``, as the generated ``RELEASES`` table does in the runtime).
Each of these compute tasks is labelled with its action (``1F0``; the prologue ``prologue``), so a
recorded timeline names it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from lightning_nnscaler.ir.tensor import dtype_bytes
from lightning_nnscaler.materialize.program import Assemble, Collective, Compute as ComputeAction, Program, Recv as RecvAction, Send as SendAction
from lightning_nnscaler.sim.costs import FLOATING, ComputeModel
from lightning_nnscaler.materialize.kept import KeptBytes, backward_seed_bytes
from lightning_nnscaler.materialize.posts import receive_posts
from lightning_nnscaler.materialize.releases import Message, pipeline_releases
from lightning_nnscaler.sim.tasks import Collective as CollectiveTask, Compute, Recv, Send, Task, WaitCollectives
from lightning_nnscaler.sim.transient import OpMemory, TransientBytes, backward_peaks

BUCKET_BYTES = 25 * 1024 * 1024
"""``runtime.reducer.BUCKET_BYTES`` (DDP's default bucket size), repeated: the simulator may not import the runtime."""
WEIGHT_PASS_SHARE = 1.0
"""A W action's share of its segment's backward time (see the module docstring); B's is 0.5."""
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


class TaskBuilder:
    """Turns a plan's programs into ``sim.tasks`` lists, pricing ops with ``compute``.

    ``compute`` must give ``op_time(op)``, ``optimizer_seconds(tensor_numels)`` and ``copy_seconds(nbytes)``
    (``sim.model.DeviceModel`` does).
    """

    def __init__(self, plan: Any, compute: ComputeModel) -> None:
        self.plan, self.compute = plan, compute
        self.program: Program = plan.program
        self.message_bytes = {
            (action.src, rank_program.rank, action.tag): math.prod(action.shape) * dtype_bytes(action.dtype)
            for rank_program in self.program.ranks for action in rank_program.actions if isinstance(action, RecvAction)
        }
        self.element_bytes = {tensor.name: dtype_bytes(tensor.dtype) for tensor in plan.graph.parameters}
        self.trained = {tensor.name for tensor in plan.graph.parameters if tensor.requires_grad}
        self.posts = receive_posts(self.program)
        """Inline receives posted where their message is sent (``materialize.posts``): no late receive."""
        self.releases = pipeline_releases(self.program, [[str(action) for action in plan.pipeline.actions(rank)]
                                                          for rank in range(self.program.world_size)]) if plan.pipeline else None
        """Per rank, which sent messages each received one proves taken (the runtime's ``RELEASES``)."""
        self._made: set[str] = set()
        """Parameter pieces whose gradients exist so far in the rank's step being built."""

    def _trains(self, name: str) -> bool:
        return name in self.trained

    def lists(self) -> list[list[Task]]:
        """Every rank's tasks for one training step."""
        return [self.rank_tasks(rank) for rank in range(self.program.world_size)]

    def rank_tasks(self, rank: int) -> list[Task]:
        """Rank ``rank``'s tasks: gathers, forward and backward (or the schedule), reduction, optimizer step."""
        segments = self._segments(rank)
        self._made = set(self._bucketed(rank))  # gradients held all along: the reducer's buckets
        tasks: list[Task] = []
        if self.plan.zero_stage == 3:
            tasks += [CollectiveTask("all_gather", ranks, nbytes, "zero3 gather") for ranks, nbytes in _zero_buckets(self._replicated(rank))]
        if self.plan.pipeline is None:
            segment = segments.get(None, _Segment())
            tasks += self._forward(segment, rank)
            tasks += self._backward(segment, rank, 1.0)
        else:
            tasks += self._scheduled(segments, rank)
        tasks += self._reduction(rank)
        return tasks

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
                chunk.ops.append(transient.op_memory(action, op_kept))
            elif isinstance(action, Assemble):
                nbytes = math.prod(action.piece.shape) * dtype_bytes(action.piece.tensor.dtype)
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
                tasks.append(Send(item.dst, self.message_bytes.get((rank, item.dst, item.tag), 0)))
            elif isinstance(item, RecvAction):
                tasks.append(Recv(item.src, posted=(item.src, rank, item.tag) in self.posts))
            elif isinstance(item, Collective):
                tasks.append(CollectiveTask(item.kind, tuple(sorted(item.ranks)), item.bytes_per_device))
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
                tasks.append(Recv(item.dst))
            elif isinstance(item, RecvAction) and item.dtype in FLOATING:
                tasks.append(Send(item.src, self.message_bytes.get((item.src, rank, item.tag), 0)))
            elif isinstance(item, Collective):
                tasks.append(CollectiveTask(ADJOINT.get(item.kind, item.kind), tuple(sorted(item.ranks)), item.bytes_per_device))
        return tasks

    def _floating_message(self, src: int, dst: int, tag: int) -> bool:
        receiver = self.program.ranks[dst]
        return any(isinstance(action, RecvAction) and action.src == src and action.tag == tag and action.dtype in FLOATING for action in receiver.actions)

    # --- a pipeline's schedule -------------------------------------------------------------------------

    def _scheduled(self, segments: dict[Any, _Segment], rank: int) -> list[Task]:
        actions = self.plan.pipeline.actions(rank)
        splits = any(action.kind.value == "W" for action in actions)
        backward_stages = {action.stage for action in actions if action.kind.value == "B"}
        seeds = backward_seed_bytes(self.program, rank)
        tasks: list[Task] = []
        for key, segment in segments.items():
            if key is not None and key[0] < 0:  # the prologue, once, without gradients
                tasks += self._forward(segment, rank, keep=False, label="prologue")
        for action in actions:
            segment = segments.get((action.stage, action.microbatch), _Segment())
            kind = action.kind.value
            if kind == "F":
                tasks += [Recv(message.src, releases=self._released(rank, Message(message.src, rank, message.tag, False)))
                          for message in segment.inputs if message.src != rank]
                tasks += self._forward(segment, rank, keep=action.stage in backward_stages, label=str(action))
                tasks += [Send(message.dst, self.message_bytes.get((rank, message.dst, message.tag), 0)) for message in segment.outputs if message.dst != rank]
            elif kind == "B":
                seed = seeds.get((action.stage, action.microbatch), 0)  # held while B runs (until W when split)
                tasks += [Recv(message.dst, releases=self._released(rank, Message(message.dst, rank, message.tag, True)))
                          for message in segment.outputs if message.dst != rank and message.gradient]
                tasks.append(Compute(0.0, "backward", str(action), activation_bytes=seed))
                tasks += self._backward(segment, rank, 0.5 if splits else 1.0, release=not splits, label=str(action))
                tasks += [] if splits else [Compute(0.0, "backward", str(action), activation_bytes=-seed)]
                tasks += [Send(message.src, self.message_bytes.get((message.src, rank, message.tag), 0))
                          for message in segment.inputs if message.src != rank and message.gradient]
            else:
                chunks = [item for item in segment.items if isinstance(item, _Chunk)]
                seed = seeds.get((action.stage, action.microbatch), 0)
                tasks.append(Compute(sum(item.backward * WEIGHT_PASS_SHARE + item.recompute for item in chunks), "weight",
                                     str(action), activation_bytes=-(segment.kept + seed)))
        return tasks

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

    def _replicated(self, rank: int) -> list[tuple[tuple[int, ...], int, int]]:
        """``(ranks, padded bytes, numel)`` of each box this rank holds with others, in registration order."""
        boxes = []
        for group in self.program.gradient_groups:
            if rank in group.ranks and len(group.ranks) > 1:
                numel = math.prod(stop - start for start, stop in group.box)
                padded = math.ceil(numel / len(group.ranks)) * len(group.ranks)
                boxes.append((tuple(group.ranks), padded * self.element_bytes.get(group.name, 4), numel))
        return boxes

    def _reduction(self, rank: int) -> list[Task]:
        everyone = tuple(range(self.program.world_size))
        # runtime.executor: a plan that does not pipeline sums the loss while its gradients are summed; a pipeline
        # starts the sum once its gradient sums are done, and waits for it before the optimizer step.
        pipelined = self.program.pipelined
        tasks: list[Task] = [] if pipelined else [CollectiveTask("all_reduce", everyone, 8, "loss sum", blocking=False)]
        replicated = self._replicated(rank)
        stage = self.plan.zero_stage
        if stage == 0:
            for ranks, nbytes in _buckets(replicated):
                tasks.append(CollectiveTask("all_reduce", ranks, nbytes, "gradient bucket", blocking=False))
        else:
            tasks += [CollectiveTask("reduce_scatter", ranks, nbytes, "zero gradients") for ranks, nbytes in _zero_buckets(replicated)]
        tasks.append(WaitCollectives("gradients"))
        if pipelined:
            tasks.append(CollectiveTask("all_reduce", everyone, 8, "loss sum"))
        tasks.append(Compute(self.compute.optimizer_seconds(self._stepped(rank)), "optimizer", "AdamW"))
        if stage == 1:
            tasks += [CollectiveTask("all_gather", ranks, nbytes, "zero1 gather") for ranks, nbytes in _zero_buckets(replicated)]
        return tasks

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


def _zero_buckets(replicated: list[tuple[tuple[int, ...], int, int]]) -> list[tuple[tuple[int, ...], int]]:
    """ZeRO's buckets: per ranks tuple, boxes in registration order cut at ``BUCKET_BYTES``, by ranks tuple."""
    return sorted(_buckets(replicated, reverse=False), key=lambda bucket: bucket[0])


def _buckets(replicated: list[tuple[tuple[int, ...], int, int]], reverse: bool = True) -> list[tuple[tuple[int, ...], int]]:
    """Stage 0's buckets: per ranks tuple, boxes in reverse registration order cut at ``BUCKET_BYTES``."""
    by_group: dict[tuple[int, ...], list[int]] = {}
    for ranks, nbytes, _ in (reversed(replicated) if reverse else replicated):
        by_group.setdefault(ranks, []).append(nbytes)
    buckets = []
    for ranks, sizes in by_group.items():
        size = 0
        for nbytes in sizes:
            size += nbytes
            if size >= BUCKET_BYTES:
                buckets.append((ranks, size))
                size = 0
        if size:
            buckets.append((ranks, size))
    return buckets


def plan_task_lists(plan: Any, compute: ComputeModel) -> list[list[Task]]:
    """Every rank's tasks for one training step of ``plan`` (see the module docstring)."""
    return TaskBuilder(plan, compute).lists()
