"""Gradient reduction for parameter boxes held by several ranks: buckets, ZeRO stage 1 and 3.

A box held by ranks ``g`` (data-parallel replicas, or replicas a plan made) gets the sum of their
gradients. Stage 0 all-reduces gradients in flat buckets, overlapped with backward: the buckets are
fixed at construction (each ``ranks`` tuple's boxes in reverse registration order, roughly the order
backward produces their gradients, cut at ``BUCKET_BYTES``), a post-accumulate-grad hook on each box
notes its gradient, and a bucket whose boxes all have theirs starts an asynchronous all-reduce.
Buckets of a tuple start in index order on every rank whatever order the hooks fire in (a ready
bucket waits for the ones before it), so the ranks' async sums pair up. ``after_backward`` starts
the rest (a box that got no gradient contributes zeros), waits for all, and copies the sums back.
ZeRO splits each box's flattened
elements into ``len(g)`` equal chunks (the last padded): rank ``g[i]`` owns chunk ``i``.
Stage 1: gradients are reduce-scattered onto the chunks, the optimizer updates only its chunk
(so its state is 1/len(g) of the box), and the chunks are all-gathered back into the box.
Stage 3: the box itself is freed between steps; it is all-gathered from the chunks before the
forward pass, so parameters, gradients and optimizer state at rest are all 1/len(g).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

BUCKET_BYTES = 25 * 1024 * 1024  # the bucket size DDP defaults to


@dataclass
class _Owned:
    """This rank's chunk of a replicated box."""

    box: torch.nn.Parameter
    ranks: tuple[int, ...]
    chunk: torch.nn.Parameter
    numel: int
    shape: torch.Size


@dataclass
class _Bucket:
    """Boxes whose gradients are summed as one flat tensor over ``ranks``."""

    ranks: tuple[int, ...]
    index: int  # position among the buckets of ``ranks``: the order they start in
    parameters: list[torch.nn.Parameter]
    arrived: set[int] = field(default_factory=set)  # ids of the boxes whose gradient this step has
    handle: Any = None  # the all_reduce_async in flight, once started


@dataclass
class _GroupQueue:
    """The buckets of one ``ranks`` tuple and how many of them have started this step."""

    buckets: list[_Bucket]
    started: int = 0


class GradientReducer:
    """Sums replicated gradients during backward (stage 0); with ZeRO, owns the optimizer's chunks.

    Attributes:
        started_buckets: stage 0: ``(ranks, bucket index, during_backward)`` of each bucket started
            in the current or last step, in start order (``during_backward`` is False for the
            buckets ``after_backward`` had to start).
    """

    def __init__(self, replicated: list[tuple[torch.nn.Parameter, tuple[int, ...]]], communicator: Any, rank: int, zero_stage: int = 0) -> None:
        if zero_stage not in (0, 1, 3):
            raise ValueError(f"zero_stage must be 0, 1 or 3, got {zero_stage!r}")
        self.communicator = communicator
        self.zero_stage = zero_stage
        self.replicated = replicated
        self.owned: list[_Owned] = []
        if zero_stage:
            for box, ranks in replicated:
                self.owned.append(self._own(box, ranks, rank))
            if zero_stage == 3:
                self.release_boxes()
        self._queues: dict[tuple[int, ...], _GroupQueue] = {}
        self._bucket_of: dict[int, _Bucket] = {}
        self.started_buckets: list[tuple[tuple[int, ...], int, bool]] = []
        self._step_open = False  # a bucket of this step has started (started_buckets is this step's)
        self._hooks: list[Any] = []
        if not zero_stage:
            self._assign_buckets()

    def _assign_buckets(self) -> None:
        """Fix the buckets: per ranks tuple, boxes in reverse registration order, ~``BUCKET_BYTES`` each; hook every box."""
        by_group: dict[tuple[int, ...], list[torch.nn.Parameter]] = {}
        for parameter, ranks in reversed(self.replicated):
            by_group.setdefault(tuple(ranks), []).append(parameter)
        for ranks, parameters in by_group.items():
            buckets: list[_Bucket] = []
            current: list[torch.nn.Parameter] = []
            size = 0
            for parameter in parameters:
                current.append(parameter)
                size += parameter.numel() * parameter.element_size()
                if size >= BUCKET_BYTES:
                    buckets.append(_Bucket(ranks, len(buckets), current))
                    current, size = [], 0
            if current:
                buckets.append(_Bucket(ranks, len(buckets), current))
            self._queues[ranks] = _GroupQueue(buckets)
            for bucket in buckets:
                for parameter in bucket.parameters:
                    if id(parameter) in self._bucket_of:
                        raise ValueError(f"a replicated box is listed twice (ranks {ranks})")
                    self._bucket_of[id(parameter)] = bucket
                    if parameter.requires_grad:  # a box without gradients contributes zeros at after_backward
                        self._hooks.append(parameter.register_post_accumulate_grad_hook(self._on_gradient))

    def _on_gradient(self, parameter: torch.Tensor) -> None:
        """Post-accumulate-grad hook: note the gradient; start every bucket that is ready and next in order."""
        bucket = self._bucket_of[id(parameter)]
        if bucket.handle is not None:
            raise RuntimeError(
                f"a gradient was accumulated into a box of ranks {bucket.ranks} after its bucket's all-reduce started; "
                "call after_backward() after each backward"
            )
        bucket.arrived.add(id(parameter))
        self._start_ready(self._queues[bucket.ranks])

    def _start_ready(self, queue: _GroupQueue) -> None:
        while queue.started < len(queue.buckets):
            bucket = queue.buckets[queue.started]
            if len(bucket.arrived) < len(bucket.parameters):
                return
            self._start(bucket, during_backward=True)
            queue.started += 1

    def _start(self, bucket: _Bucket, during_backward: bool) -> None:
        for parameter in bucket.parameters:
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
        flat = torch.cat([parameter.grad.detach().reshape(-1) for parameter in bucket.parameters])
        if not self._step_open:
            self.started_buckets, self._step_open = [], True
        bucket.handle = self.communicator.all_reduce_async(flat, bucket.ranks)
        self.started_buckets.append((bucket.ranks, bucket.index, during_backward))

    def _own(self, box: torch.nn.Parameter, ranks: tuple[int, ...], rank: int) -> _Owned:
        numel = box.numel()
        size = math.ceil(numel / len(ranks))
        flat = torch.nn.functional.pad(box.detach().reshape(-1), (0, size * len(ranks) - numel))
        index = ranks.index(rank)
        chunk = torch.nn.Parameter(flat[index * size : (index + 1) * size].clone())
        return _Owned(box, ranks, chunk, numel, box.shape)

    def optimizer_parameters(self, parameters: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
        """What the optimizer should update: owned chunks instead of replicated boxes under ZeRO."""
        if not self.zero_stage:
            return parameters
        replaced = {id(owned.box) for owned in self.owned}
        return [parameter for parameter in parameters if id(parameter) not in replaced] + [owned.chunk for owned in self.owned]

    def before_forward(self) -> None:
        """ZeRO-3: gather every box from its chunks."""
        if self.zero_stage == 3:
            self.gather_boxes()

    def after_backward(self) -> None:
        """Sum the replicated gradients (buckets), or reduce-scatter them onto the owned chunks."""
        if not self.zero_stage:
            self._finish_buckets()
            return
        for owned in self.owned:
            grad = owned.box.grad if owned.box.grad is not None else torch.zeros(owned.shape, dtype=owned.box.dtype, device=owned.box.device)
            flat = torch.nn.functional.pad(grad.reshape(-1), (0, owned.chunk.numel() * len(owned.ranks) - owned.numel))
            owned.chunk.grad = self.communicator.reduce_scatter(flat, 0, owned.ranks)
            owned.box.grad = None

    def after_optimizer_step(self) -> None:
        """ZeRO-1: gather the updated chunks into the boxes; ZeRO-3: keep only the chunks."""
        if self.zero_stage == 1:
            self.gather_boxes()
        elif self.zero_stage == 3:
            self.release_boxes()

    def gather_boxes(self) -> None:
        """Rebuild every replicated box from the owned chunks of its ranks."""
        for owned in self.owned:
            flat = self.communicator.all_gather(owned.chunk.detach(), 0, owned.ranks)
            owned.box.data = flat[: owned.numel].reshape(owned.shape).clone()

    def gathered_gradients(self) -> dict[int, torch.Tensor]:
        """ZeRO: each replicated box's summed gradient, gathered from the chunks (by ``id(box)``)."""
        gradients = {}
        for owned in self.owned:
            grad = owned.chunk.grad if owned.chunk.grad is not None else torch.zeros_like(owned.chunk)
            gradients[id(owned.box)] = self.communicator.all_gather(grad.detach(), 0, owned.ranks)[: owned.numel].reshape(owned.shape)
        return gradients

    def release_boxes(self) -> None:
        """Free the replicated boxes' storage (ZeRO-3 at rest)."""
        for owned in self.owned:
            owned.box.data = torch.empty(0, dtype=owned.box.dtype, device=owned.box.device)
            owned.box.grad = None

    def _finish_buckets(self) -> None:
        """Start the buckets backward did not start (in order), wait for every bucket, copy the sums back."""
        for queue in self._queues.values():
            for bucket in queue.buckets[queue.started :]:
                self._start(bucket, during_backward=False)
            queue.started = len(queue.buckets)
        try:
            for queue in self._queues.values():
                for bucket in queue.buckets:
                    summed = bucket.handle.wait()
                    offset = 0
                    for parameter in bucket.parameters:
                        count = parameter.grad.numel()
                        parameter.grad.copy_(summed[offset : offset + count].view_as(parameter.grad))
                        offset += count
        finally:
            self._step_open = False
            for queue in self._queues.values():
                queue.started = 0
                for bucket in queue.buckets:
                    bucket.arrived.clear()
                    bucket.handle = None
