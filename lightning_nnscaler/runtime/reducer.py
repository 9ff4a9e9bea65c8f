"""Gradient reduction for parameter boxes held by several ranks: buckets, ZeRO stage 1 and 3.

A box held by ranks ``g`` (data-parallel replicas, or replicas a plan made) gets the sum of their
gradients. Stage 0 all-reduces gradients in flat buckets, overlapped with backward, as DDP does:

- The buckets are fixed at construction: each ``ranks`` tuple's boxes in reverse registration order
  (roughly the order backward produces their gradients), cut at ``BUCKET_BYTES`` and at changes of
  dtype or device. DDP's small first bucket, and smaller buckets (a model below ``BUCKET_BYTES``
  split in 2 to 8 so that its sums overlap backward), measured 1-4% slower per step on 2 gloo ranks
  sharing 2 CPU cores: a sum there competes with backward for the cores instead of hiding behind it.
- Each bucket owns one flat tensor. A box's gradient *is* its view of it after a reduction, so a
  gradient is copied at most once (into the view, when autograd made a fresh one) and the sum is
  written in place: nothing is copied back, and no second copy of the gradients exists (DDP's
  ``gradient_as_bucket_view``). A backward therefore overwrites the previous sums: whoever wants to
  keep them past the next step clones them (``NnScalerStrategy`` drops them first, as Lightning's
  ``zero_grad`` would, unless a hook reads them before ``zero_grad``).
- A post-accumulate-grad hook on each box moves its gradient into the bucket; a bucket whose boxes
  all have theirs starts an asynchronous in-place all-reduce. Buckets of a tuple start in index
  order on every rank whatever order the hooks fire in (a ready bucket waits for the ones before
  it), so the ranks' async sums pair up. ``after_backward`` starts the rest (a box that got no
  gradient contributes zeros, or what it accumulated earlier) and waits for all.
- ``before_backward(reduce_gradients=False)`` skips the reduction (DDP's ``no_sync``): gradients
  accumulate locally, and the next reducing backward sums the accumulated ones. Gradients still
  holding an earlier sum at a backward (nobody cleared them) are set aside and added back after
  the new sum, so that backward calls accumulate as in plain torch.
- ``on_bucket_reduced`` (optional) is called with each bucket's boxes as soon as that bucket's sum
  has arrived, in start order, while later buckets are still in flight: ``NnScalerStrategy`` steps
  the optimizer over them there (``strategy.overlap``).

The gradients are views of buckets that the next reducing backward overwrites: clone them to keep them.

ZeRO splits each box's flattened elements into ``len(g)`` equal chunks (the last padded): rank
``g[i]`` owns chunk ``i``. Every backward reduce-scatters the box gradients and adds them to the
chunks' gradients. Stage 1: the optimizer updates only its chunk (so its state is 1/len(g) of the
box), and the chunks are all-gathered back into the box. Stage 3: the box itself is freed between
steps; it is all-gathered from the chunks before the forward pass, so parameters, gradients and
optimizer state at rest are all 1/len(g).

ZeRO's collectives run per bucket, not per box: the boxes of one ranks tuple in registration order,
cut at ``BUCKET_BYTES`` and at changes of dtype or device; the buckets go by ranks tuple. A bucket's
flat buffer is ``len(g)`` rows, row ``i`` holding chunk ``i`` of every box side by side, so one
reduce-scatter hands each rank its row (all its chunks; their gradients are views of it) and one
all-gather rebuilds every box. A box's chunks are the same as per box
(checkpoints and the optimizer see no difference); a step makes one collective per bucket where it
made one per box (69 on the reference GPT, whose gloo reduce-scatters then cost 10x dp's step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch.utils.hooks import RemovableHandle

from lightning_nnscaler.runtime.comm import AsyncHandle, Communicator

BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket_cap_mb


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
    buffer: torch.Tensor  # every box's gradient, back to back
    views: dict[int, torch.Tensor]  # id(box) -> its gradient's place in the buffer
    arrived: set[int] = field(default_factory=set)  # ids of the boxes whose gradient this step has
    carried: dict[int, torch.Tensor] = field(default_factory=dict)  # id(box) -> an earlier sum to add back
    handle: AsyncHandle | None = None  # the all_reduce_async in flight, once started


@dataclass
class _ZeroBucket:
    """Owned chunks of boxes held by the same ``ranks``, reduced and gathered by one collective each."""

    ranks: tuple[int, ...]
    owned: list[_Owned]

    @property
    def widths(self) -> list[int]:
        """Each box's chunk size: its columns of the bucket's ``len(ranks)`` rows."""
        return [owned.chunk.numel() for owned in self.owned]

    def rows(self, flats: list[torch.Tensor]) -> torch.Tensor:
        """The boxes' padded flat tensors as the bucket's buffer: row ``i`` holds chunk ``i`` of each, side by side."""
        return torch.cat([flat.reshape(len(self.ranks), -1) for flat in flats], dim=1)

    def columns(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Each box's flat elements (padding dropped) from the bucket's ``len(ranks)`` gathered rows."""
        return [part.reshape(-1)[: owned.numel] for part, owned in zip(rows.split(self.widths, dim=1), self.owned, strict=True)]


def _zero_buckets(owned: list[_Owned], bucket_bytes: int) -> list[_ZeroBucket]:
    """ZeRO's buckets: per ranks tuple, boxes in registration order cut at ``bucket_bytes``, one dtype and device each."""
    buckets: list[_ZeroBucket] = []
    open_buckets: dict[tuple[int, ...], tuple[_ZeroBucket, int]] = {}
    for chunk in owned:
        current = open_buckets.get(chunk.ranks)
        if current is not None:
            first = current[0].owned[0].box
            if (first.dtype, first.device) != (chunk.box.dtype, chunk.box.device) or current[1] >= bucket_bytes:
                current = None
        if current is None:
            current = (_ZeroBucket(chunk.ranks, []), 0)
            buckets.append(current[0])
        current[0].owned.append(chunk)
        open_buckets[chunk.ranks] = (current[0], current[1] + chunk.numel * chunk.box.element_size())
    # Every rank runs its groups' collectives in one global order of the groups: no two ranks can wait
    # on each other in different groups.
    return sorted(buckets, key=lambda bucket: bucket.ranks)


@dataclass
class _GroupQueue:
    """The buckets of one ``ranks`` tuple and how many of them have started this step."""

    buckets: list[_Bucket]
    started: int = 0


def _new_bucket(ranks: tuple[int, ...], index: int, parameters: list[torch.nn.Parameter]) -> _Bucket:
    numel = sum(parameter.numel() for parameter in parameters)
    buffer = torch.zeros(numel, dtype=parameters[0].dtype, device=parameters[0].device)
    views, offset = {}, 0
    for parameter in parameters:
        views[id(parameter)] = buffer[offset : offset + parameter.numel()].view(parameter.shape)
        offset += parameter.numel()
    return _Bucket(ranks, index, parameters, buffer, views)


class GradientReducer:
    """Sums replicated gradients during backward (stage 0); with ZeRO, owns the optimizer's chunks.

    Attributes:
        started_buckets: stage 0: ``(ranks, bucket index, during_backward)`` of each bucket started
            in the current or last step, in start order (``during_backward`` is False for the
            buckets ``after_backward`` had to start).
        on_bucket_reduced: called with a bucket's boxes once its sum is in their gradients (see the
            module docstring); None: nobody is told.
    """

    def __init__(
        self, replicated: list[tuple[torch.nn.Parameter, tuple[int, ...]]], communicator: Communicator, rank: int, zero_stage: int = 0,
        bucket_bytes: int | None = None,
    ) -> None:
        if zero_stage not in (0, 1, 3):
            raise ValueError(f"zero_stage must be 0, 1 or 3, got {zero_stage!r}")
        self.communicator = communicator
        self.zero_stage = zero_stage
        self.replicated = replicated
        self.owned: list[_Owned] = []
        if zero_stage:
            for box, ranks in replicated:
                self.owned.append(self._own(box, ranks, rank))
            # In backward's order (reverse registration), so buckets fill and are reduce-scattered while backward runs.
            self._zero_buckets = _zero_buckets(self.owned[::-1], BUCKET_BYTES if bucket_bytes is None else bucket_bytes)
            if zero_stage == 3:
                self.release_boxes()
        self._queues: dict[tuple[int, ...], _GroupQueue] = {}
        self._bucket_of: dict[int, _Bucket] = {}
        self.started_buckets: list[tuple[tuple[int, ...], int, bool]] = []
        self._step_open = False  # a bucket of this step has started (started_buckets is this step's)
        self._reducing = True  # this backward sums (False: DDP's no_sync)
        self._hooks: list[RemovableHandle] = []
        self.on_bucket_reduced: Callable[[list[torch.nn.Parameter]], None] | None = None
        self._zero_next = 0  # ZeRO: the next bucket to reduce-scatter this backward (they go in one order on every rank)
        self._zero_arrived: set[int] = set()  # ZeRO: ids of the boxes whose gradient this backward has accumulated
        if not zero_stage:
            self._assign_buckets(BUCKET_BYTES if bucket_bytes is None else bucket_bytes)
        else:
            for owned in self.owned:
                if owned.box.requires_grad:
                    self._hooks.append(owned.box.register_post_accumulate_grad_hook(self._on_zero_gradient))

    def _assign_buckets(self, bucket_bytes: int) -> None:
        """Fix the buckets: per ranks tuple, boxes in reverse registration order, ~``bucket_bytes`` each,
        one dtype and device each. Hook every box."""
        by_group: dict[tuple[int, ...], list[torch.nn.Parameter]] = {}
        for parameter, ranks in reversed(self.replicated):
            by_group.setdefault(tuple(ranks), []).append(parameter)
        for ranks, parameters in by_group.items():
            buckets: list[_Bucket] = []
            current: list[torch.nn.Parameter] = []
            size = 0
            for parameter in parameters:
                if current and (parameter.dtype, parameter.device) != (current[0].dtype, current[0].device):
                    buckets.append(_new_bucket(ranks, len(buckets), current))
                    current, size = [], 0
                current.append(parameter)
                size += parameter.numel() * parameter.element_size()
                if size >= bucket_bytes:
                    buckets.append(_new_bucket(ranks, len(buckets), current))
                    current, size = [], 0
            if current:
                buckets.append(_new_bucket(ranks, len(buckets), current))
            self._queues[ranks] = _GroupQueue(buckets)
            for bucket in buckets:
                for parameter in bucket.parameters:
                    if id(parameter) in self._bucket_of:
                        raise ValueError(f"a replicated box is listed twice (ranks {ranks})")
                    self._bucket_of[id(parameter)] = bucket
                    if parameter.requires_grad:  # a box without gradients contributes zeros at after_backward
                        self._hooks.append(parameter.register_post_accumulate_grad_hook(self._on_gradient))

    def _on_gradient(self, parameter: torch.Tensor) -> None:
        """Post-accumulate-grad hook: move the gradient into its bucket; start every bucket that is ready and next in order."""
        if not self._reducing:
            return
        bucket = self._bucket_of[id(parameter)]
        if bucket.handle is not None:
            raise RuntimeError(
                f"a gradient was accumulated into a box of ranks {bucket.ranks} after its bucket's all-reduce started; "
                "call after_backward() after each backward"
            )
        _move_into_bucket(parameter, bucket)
        bucket.arrived.add(id(parameter))
        self._start_ready(self._queues[bucket.ranks])

    def _on_zero_gradient(self, box: torch.Tensor) -> None:
        """Post-accumulate-grad hook (ZeRO): reduce-scatter every bucket whose boxes all have their gradient, in
        order, freeing their whole-size gradients while backward goes on."""
        self._zero_arrived.add(id(box))
        while self._zero_next < len(self._zero_buckets):
            bucket = self._zero_buckets[self._zero_next]
            if any(id(owned.box) not in self._zero_arrived for owned in bucket.owned):
                return
            self._reduce_scatter(bucket)
            self._zero_next += 1

    def _reduce_scatter(self, bucket: _ZeroBucket) -> None:
        """Sum the bucket's box gradients onto the owned chunks (added to what they hold) and free the box gradients."""
        flats = []
        for owned in bucket.owned:
            grad = owned.box.grad if owned.box.grad is not None else torch.zeros(owned.shape, dtype=owned.box.dtype, device=owned.box.device)
            flats.append(torch.nn.functional.pad(grad.reshape(-1), (0, owned.chunk.numel() * len(owned.ranks) - owned.numel)))
            owned.box.grad = None
        row = self.communicator.reduce_scatter(bucket.rows(flats), 0, bucket.ranks).reshape(-1)
        for owned, reduced in zip(bucket.owned, row.split(bucket.widths), strict=True):
            owned.chunk.grad = reduced if owned.chunk.grad is None else owned.chunk.grad.add_(reduced)

    def _start_ready(self, queue: _GroupQueue) -> None:
        while queue.started < len(queue.buckets):
            bucket = queue.buckets[queue.started]
            if len(bucket.arrived) < len(bucket.parameters):
                return
            self._start(bucket, during_backward=True)
            queue.started += 1

    def _start(self, bucket: _Bucket, during_backward: bool) -> None:
        for parameter in bucket.parameters:
            if id(parameter) not in bucket.arrived:
                _move_into_bucket(parameter, bucket)
        if not self._step_open:
            self.started_buckets, self._step_open = [], True
        bucket.handle = self.communicator.all_reduce_async(bucket.buffer, bucket.ranks, in_place=True)
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

    def before_backward(self, reduce_gradients: bool = True) -> None:
        """Call before each backward. ``reduce_gradients=False`` (stage 0) only accumulates locally; ZeRO
        reduce-scatters every backward. Earlier sums still held as gradients are set aside to add back."""
        self._reducing = reduce_gradients
        for queue in self._queues.values():
            for bucket in queue.buckets:
                for parameter in bucket.parameters:
                    if parameter.grad is not None and id(parameter) not in bucket.carried and _is_bucket_view(parameter, bucket):
                        bucket.carried[id(parameter)] = parameter.grad.clone()
                        parameter.grad = None

    def after_backward(self) -> None:
        """Sum the replicated gradients (buckets), or reduce-scatter them onto the owned chunks."""
        reducing, self._reducing = self._reducing, True
        if not self.zero_stage:
            if reducing:
                self._finish_buckets()
            return
        try:
            for bucket in self._zero_buckets[self._zero_next :]:  # those backward did not complete
                self._reduce_scatter(bucket)
        finally:
            self._zero_next = 0
            self._zero_arrived.clear()

    def after_optimizer_step(self) -> None:
        """ZeRO-1: gather the updated chunks into the boxes; ZeRO-3: keep only the chunks."""
        if self.zero_stage == 1:
            self.gather_boxes()
        elif self.zero_stage == 3:
            self.release_boxes()

    def gather_boxes(self) -> None:
        """Rebuild every replicated box from the owned chunks of its ranks."""
        for bucket, rows in self._gathered_rows(lambda owned: owned.chunk.detach()):
            for owned, flat in zip(bucket.owned, bucket.columns(rows), strict=True):
                owned.box.data = flat.reshape(owned.shape).clone()

    def _gathered_rows(self, chunk_of: Callable[[_Owned], torch.Tensor]) -> Iterator[tuple[_ZeroBucket, torch.Tensor]]:
        """Per bucket, one at a time, its ``len(ranks)`` rows all-gathered from every rank's chunks (``chunk_of`` each)."""
        for bucket in self._zero_buckets:
            row = torch.cat([chunk_of(owned).reshape(-1) for owned in bucket.owned])
            yield bucket, self.communicator.all_gather(row, 0, bucket.ranks).reshape(len(bucket.ranks), -1)

    def gathered_gradients(self) -> dict[int, torch.Tensor]:
        """ZeRO: each replicated box's summed gradient, gathered from the chunks (by ``id(box)``)."""
        gradients = {}
        def gradient_of(owned: _Owned) -> torch.Tensor:
            return owned.chunk.grad.detach() if owned.chunk.grad is not None else torch.zeros_like(owned.chunk)
        for bucket, rows in self._gathered_rows(gradient_of):
            for owned, flat in zip(bucket.owned, bucket.columns(rows), strict=True):
                gradients[id(owned.box)] = flat.reshape(owned.shape)
        return gradients

    def release_boxes(self) -> None:
        """Free the replicated boxes' storage (ZeRO-3 at rest)."""
        for owned in self.owned:
            owned.box.data = torch.empty(0, dtype=owned.box.dtype, device=owned.box.device)
            owned.box.grad = None

    def _finish_buckets(self) -> None:
        """Start the buckets backward did not start (in order); wait for each bucket in turn, add back what
        was set aside and tell ``on_bucket_reduced`` while the later buckets are still in flight."""
        for queue in self._queues.values():
            for bucket in queue.buckets[queue.started :]:
                self._start(bucket, during_backward=False)
            queue.started = len(queue.buckets)
        try:
            for queue in self._queues.values():
                for bucket in queue.buckets:
                    bucket.handle.wait()
                    for key, earlier in bucket.carried.items():
                        bucket.views[key].add_(earlier)
                    if self.on_bucket_reduced is not None:
                        self.on_bucket_reduced(bucket.parameters)
        finally:
            self._step_open = False
            for queue in self._queues.values():
                queue.started = 0
                for bucket in queue.buckets:
                    bucket.arrived.clear()
                    bucket.carried.clear()
                    bucket.handle = None


def _move_into_bucket(parameter: torch.Tensor, bucket: _Bucket) -> None:
    """Make ``parameter.grad`` its view of the bucket: copied in unless autograd accumulated there (zeros if none)."""
    view = bucket.views[id(parameter)]
    grad = parameter.grad
    if grad is None:
        view.zero_()
    elif grad.data_ptr() != view.data_ptr():
        view.copy_(grad)
    parameter.grad = view


def _is_bucket_view(parameter: torch.Tensor, bucket: _Bucket) -> bool:
    """Whether ``parameter.grad`` is (in the place of) its view of the bucket."""
    return parameter.grad.data_ptr() == bucket.views[id(parameter)].data_ptr()
