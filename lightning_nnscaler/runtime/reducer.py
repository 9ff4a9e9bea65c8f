"""Gradient reduction for parameter boxes held by several ranks: buckets, ZeRO stage 1 and 3.

A box held by ranks ``g`` (data-parallel replicas, or replicas a plan made) gets the sum of their
gradients. Stage 0 all-reduces gradients in flat buckets, overlapped with backward, as DDP does:

- The buckets are fixed at construction: the plan's (``program.buckets``: each ``ranks`` tuple's boxes in
  reverse registration order, roughly the order backward produces their gradients, cut at the bucket
  size and at changes of dtype, and put in the order their gradients complete). DDP's small first bucket, and smaller buckets (a model below ``BUCKET_BYTES``
  split in 2 to 8 so that its sums overlap backward), measured 1-4% slower per step on 2 gloo ranks
  sharing 2 CPU cores: a sum there competes with backward for the cores instead of hiding behind it.
- Each bucket owns one flat tensor. A box's gradient *is* its view of it after a reduction, so a
  gradient is copied at most once (into the view, when autograd made a fresh one) and the sum is
  written in place: nothing is copied back, and no second copy of the gradients exists (DDP's
  ``gradient_as_bucket_view``). A backward therefore overwrites the previous sums: whoever wants to
  keep them past the next step clones them (``NnScalerStrategy`` drops them first, as Lightning's
  ``zero_grad`` would, unless a hook reads them before ``zero_grad``).
- A post-accumulate-grad hook on each box moves its gradient into the bucket; a bucket whose boxes
  all have theirs starts an asynchronous in-place all-reduce. The rank's buckets start in the plan's
  order whatever order the hooks fire in (a ready bucket waits for the ones before it), so the ranks'
  async sums pair up. ``start_through(k)`` (the program's ``REDUCE bk``) starts bucket ``k`` and those
  before it if backward did not; ``after_backward`` starts the rest (a box that got no gradient
  contributes zeros, or what it accumulated earlier) and waits for all.
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
box), and the chunks are all-gathered back into the box. Stage 3: the box's storage is freed whenever the
program says (``FREE``: between steps, and in a plan cut into stages after each run of its stage's
actions) and all-gathered from the chunks where it says (``GATHER``), so parameters, gradients and
optimizer state at rest are all 1/len(g), and in the step one stage's boxes at a time.

ZeRO's collectives run per bucket, not per box, in the plan's bucket order (the same buckets as
stage 0's, each box padded to a multiple of its ranks). A bucket's
flat buffer is ``len(g)`` rows, row ``i`` holding chunk ``i`` of every box side by side, so one
reduce-scatter hands each rank its row (all its chunks; their gradients are views of it) and one
all-gather rebuilds every box. A box's chunks are the same as per box
(checkpoints and the optimizer see no difference); a step makes one collective per bucket where it
made one per box (69 on the reference GPT, whose gloo reduce-scatters then cost 10x dp's step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils.hooks import RemovableHandle

from lightning_nnscaler.program.buckets import BUCKET_BYTES, ReplicatedBox, gradient_buckets
from lightning_nnscaler.runtime.comm import AsyncHandle, Communicator


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
    index: int  # position among the buckets of ``ranks``
    order: int  # position among the rank's buckets: the order they start in (the program's ``REDUCE b<order>``)
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


def _new_bucket(ranks: tuple[int, ...], index: int, order: int, parameters: list[torch.nn.Parameter]) -> _Bucket:
    numel = sum(parameter.numel() for parameter in parameters)
    buffer = torch.zeros(numel, dtype=parameters[0].dtype, device=parameters[0].device)
    views, offset = {}, 0
    for parameter in parameters:
        views[id(parameter)] = buffer[offset : offset + parameter.numel()].view(parameter.shape)
        offset += parameter.numel()
    return _Bucket(ranks, index, order, parameters, buffer, views)


class GradientReducer:
    """Sums replicated gradients during backward (stage 0); with ZeRO, owns the optimizer's chunks.

    Args:
        replicated: ``(box, ranks)`` of each box this rank holds with others, in registration order. Under ZeRO-3
            each box must own its storage (not share a module's): the program's ``FREE`` frees it.
        communicator: The rank's communicator.
        rank: This rank.
        zero_stage: 0, 1 or 3.
        bucket_bytes: The size to cut buckets at when ``buckets`` is not given (None: ``BUCKET_BYTES``).
        buckets: The plan's buckets in the order the step sums them, each as indices into ``replicated``
            (the generated module's ``BUCKETS``); None cuts them here with ``program.buckets.gradient_buckets``.
        reduce_when_accumulated: ZeRO: reduce-scatter a bucket as soon as each of its boxes has accumulated a
            gradient (a step with one backward). False waits for the program's ``REDUCE`` (``start_through``): in a
            program of several backwards a box read by two stages accumulates twice, and its first gradient is
            not yet its whole one.

    Attributes:
        started_buckets: stage 0: ``(ranks, index among the buckets of ranks, during_backward)`` of each bucket
            started in the current or last step, in start order (``during_backward`` is False for the buckets
            started after backward: by ``start_through`` or ``after_backward``).
        on_bucket_reduced: called with a bucket's boxes once its sum is in their gradients (see the
            module docstring); None: nobody is told.
        on_bucket_started: called with a bucket's place among the rank's buckets when its sum starts (stage 0)
            or its reduce-scatter runs (ZeRO): the executor records the program's ``REDUCE b<k>`` there.
    """

    def __init__(
        self, replicated: list[tuple[torch.nn.Parameter, tuple[int, ...]]], communicator: Communicator, rank: int, zero_stage: int = 0,
        bucket_bytes: int | None = None, buckets: list[list[int]] | None = None, reduce_when_accumulated: bool = True,
    ) -> None:
        if zero_stage not in (0, 1, 3):
            raise ValueError(f"zero_stage must be 0, 1 or 3, got {zero_stage!r}")
        self.communicator = communicator
        self.zero_stage = zero_stage
        self.replicated = replicated
        self.owned: list[_Owned] = []
        members = _bucket_members(replicated, BUCKET_BYTES if bucket_bytes is None else bucket_bytes, buckets, zero_stage)
        self._buckets: list[_Bucket] = []
        self._next = 0  # stage 0: the next bucket to start this step; ZeRO: the next to reduce-scatter
        self._bucket_of: dict[int, _Bucket] = {}
        self.started_buckets: list[tuple[tuple[int, ...], int, bool]] = []
        self._step_open = False  # a bucket of this step has started (started_buckets is this step's)
        self._reducing = True  # this backward sums (False: DDP's no_sync)
        self._hooks: list[RemovableHandle] = []
        self.on_bucket_reduced: Callable[[list[torch.nn.Parameter]], None] | None = None
        self.on_bucket_started: Callable[[int], None] | None = None
        self._zero_arrived: set[int] = set()  # ZeRO: ids of the boxes whose gradient this backward has accumulated
        if zero_stage:
            owned_of = {index: self._own(box, ranks, rank) for index, (box, ranks) in enumerate(replicated)}
            self.owned = [owned_of[index] for index in range(len(replicated))]
            self._zero_buckets = [_ZeroBucket(self.owned[bucket[0]].ranks, [owned_of[index] for index in bucket]) for bucket in members]
            for owned in self.owned:
                if owned.box.requires_grad and reduce_when_accumulated:
                    self._hooks.append(owned.box.register_post_accumulate_grad_hook(self._on_zero_gradient))
            if zero_stage == 3:
                self.release_boxes()
        else:
            self._assign_buckets(members)

    def _assign_buckets(self, members: list[list[int]]) -> None:
        """Make the stage-0 buckets from their members (indices into ``replicated``) and hook every box."""
        per_ranks: dict[tuple[int, ...], int] = {}
        for order, bucket in enumerate(members):
            parameters = [self.replicated[index][0] for index in bucket]
            ranks = tuple(self.replicated[bucket[0]][1])
            self._buckets.append(_new_bucket(ranks, per_ranks.get(ranks, 0), order, parameters))
            per_ranks[ranks] = per_ranks.get(ranks, 0) + 1
        for bucket in self._buckets:
            for parameter in bucket.parameters:
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
        while self._next < len(self._buckets) and len(self._buckets[self._next].arrived) == len(self._buckets[self._next].parameters):
            self._start(self._buckets[self._next], during_backward=True)

    def _on_zero_gradient(self, box: torch.Tensor) -> None:
        """Post-accumulate-grad hook (ZeRO): reduce-scatter every bucket whose boxes all have their gradient, in
        order, freeing their whole-size gradients while backward goes on."""
        self._zero_arrived.add(id(box))
        while self._next < len(self._zero_buckets):
            bucket = self._zero_buckets[self._next]
            if any(id(owned.box) not in self._zero_arrived for owned in bucket.owned):
                return
            self._reduce_scatter(bucket)

    def start_through(self, order: int) -> None:
        """Start the sums of the rank's buckets up to ``order`` that have not started (the program's ``REDUCE b<order>``):
        a reduce-scatter onto the chunks (ZeRO, every backward), or an all-reduce each (stage 0; nothing under no_sync)."""
        if self.zero_stage:
            while self._next <= order:
                self._reduce_scatter(self._zero_buckets[self._next])
            return
        if not self._reducing:
            return
        while self._next <= order:
            self._start(self._buckets[self._next], during_backward=False)

    def _reduce_scatter(self, bucket: _ZeroBucket) -> None:
        """Sum the bucket's box gradients onto the owned chunks (added to what they hold) and free the box gradients."""
        if self.on_bucket_started is not None:
            self.on_bucket_started(self._next)
        self._next += 1
        flats = []
        for owned in bucket.owned:
            grad = owned.box.grad if owned.box.grad is not None else torch.zeros(owned.shape, dtype=owned.box.dtype, device=owned.box.device)
            flats.append(torch.nn.functional.pad(grad.reshape(-1), (0, owned.chunk.numel() * len(owned.ranks) - owned.numel)))
            owned.box.grad = None
        row = self.communicator.reduce_scatter(bucket.rows(flats), 0, bucket.ranks).reshape(-1)
        for owned, reduced in zip(bucket.owned, row.split(bucket.widths), strict=True):
            owned.chunk.grad = reduced if owned.chunk.grad is None else owned.chunk.grad.add_(reduced)

    def _start(self, bucket: _Bucket, during_backward: bool) -> None:
        for parameter in bucket.parameters:
            if id(parameter) not in bucket.arrived:
                _move_into_bucket(parameter, bucket)
        if not self._step_open:
            self.started_buckets, self._step_open = [], True
        if self.on_bucket_started is not None:
            self.on_bucket_started(bucket.order)
        self._next += 1
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

    def before_backward(self, reduce_gradients: bool = True) -> None:
        """Call before each backward. ``reduce_gradients=False`` (stage 0) only accumulates locally; ZeRO
        reduce-scatters every backward. Earlier sums still held as gradients are set aside to add back."""
        self._reducing = reduce_gradients
        for bucket in self._buckets:
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
            while self._next < len(self._zero_buckets):  # those backward did not complete
                self._reduce_scatter(self._zero_buckets[self._next])
        finally:
            self._next = 0
            self._zero_arrived.clear()

    def after_optimizer_step(self) -> None:
        """ZeRO-1: gather the updated chunks into the boxes; ZeRO-3: keep only the chunks."""
        if self.zero_stage == 1:
            self.gather_boxes()
        elif self.zero_stage == 3:
            self.release_boxes()

    @property
    def bucket_buffers(self) -> list[torch.Tensor]:
        """Stage 0: each bucket's flat gradient buffer (the replicated gradients are views of them)."""
        return [bucket.buffer for bucket in self._buckets]

    def gather_boxes(self) -> None:
        """Rebuild every replicated box from the owned chunks of its ranks."""
        for order in range(len(self._zero_buckets)):
            self.gather_bucket(order)

    def gather_bucket(self, order: int) -> None:
        """Rebuild the boxes of bucket ``order`` from the owned chunks of its ranks (the program's ``GATHER b<order>``),
        into each box's own storage: what autograd saved of a box before a ``FREE`` (the box, views of it) sees it again."""
        bucket = self._zero_buckets[order]
        rows = self._gathered_rows(bucket, lambda owned: owned.chunk.detach())
        for owned, flat in zip(bucket.owned, bucket.columns(rows), strict=True):
            storage = owned.box.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(owned.numel * owned.box.element_size())
            with torch.no_grad():
                owned.box.data.copy_(flat.reshape(owned.shape))  # .data: no version bump, so saved boxes stay valid

    def release_bucket(self, order: int) -> None:
        """Free the storage of bucket ``order``'s boxes (the program's ``FREE b<order>``): the storage itself shrinks to
        nothing, so the views autograd saved of a box free it too (as FSDP does), until ``gather_bucket`` refills it."""
        for owned in self._zero_buckets[order].owned:
            owned.box.untyped_storage().resize_(0)
            owned.box.grad = None

    def _gathered_rows(self, bucket: _ZeroBucket, chunk_of: Callable[[_Owned], torch.Tensor]) -> torch.Tensor:
        """The bucket's ``len(ranks)`` rows all-gathered from every rank's chunks (``chunk_of`` each)."""
        row = torch.cat([chunk_of(owned).reshape(-1) for owned in bucket.owned])
        return self.communicator.all_gather(row, 0, bucket.ranks).reshape(len(bucket.ranks), -1)

    def gathered_gradients(self) -> dict[int, torch.Tensor]:
        """ZeRO: each replicated box's summed gradient, gathered from the chunks (by ``id(box)``)."""
        gradients = {}
        def gradient_of(owned: _Owned) -> torch.Tensor:
            return owned.chunk.grad.detach() if owned.chunk.grad is not None else torch.zeros_like(owned.chunk)
        for bucket in self._zero_buckets:
            for owned, flat in zip(bucket.owned, bucket.columns(self._gathered_rows(bucket, gradient_of)), strict=True):
                gradients[id(owned.box)] = flat.reshape(owned.shape)
        return gradients

    def release_boxes(self) -> None:
        """Free the replicated boxes' storage (ZeRO-3 at rest)."""
        for order in range(len(self._zero_buckets)):
            self.release_bucket(order)

    def _finish_buckets(self) -> None:
        """Start the buckets backward did not start (in order); wait for each bucket in turn, add back what
        was set aside and tell ``on_bucket_reduced`` while the later buckets are still in flight."""
        while self._next < len(self._buckets):
            self._start(self._buckets[self._next], during_backward=False)
        try:
            for bucket in self._buckets:
                bucket.handle.wait()
                for key, earlier in bucket.carried.items():
                    bucket.views[key].add_(earlier)
                if self.on_bucket_reduced is not None:
                    self.on_bucket_reduced(bucket.parameters)
        finally:
            self._step_open = False
            self._next = 0
            for bucket in self._buckets:
                bucket.arrived.clear()
                bucket.carried.clear()
                bucket.handle = None


def _bucket_members(
    replicated: list[tuple[torch.nn.Parameter, tuple[int, ...]]], bucket_bytes: int, buckets: list[list[int]] | None, zero_stage: int,
) -> list[list[int]]:
    """Each bucket's boxes (indices into ``replicated``) in the order the step sums them: the plan's, checked, or cut here."""
    if buckets is None:
        boxes = [ReplicatedBox(str(index), tuple(ranks), box.numel(), box.element_size(), f"{box.dtype} on {box.device}")
                 for index, (box, ranks) in enumerate(replicated)]
        return [[int(var) for var in bucket.vars] for bucket in gradient_buckets(boxes, bucket_bytes, zero=bool(zero_stage))]
    listed = sorted(index for bucket in buckets for index in bucket)
    if listed != list(range(len(replicated))):
        raise ValueError(f"the buckets list the replicated boxes {listed}, but there are {len(replicated)}: each must be in exactly one bucket")
    for bucket in buckets:
        kinds = {(replicated[index][0].dtype, replicated[index][0].device, tuple(replicated[index][1])) for index in bucket}
        if len(kinds) > 1:
            raise ValueError(
                f"a gradient bucket mixes boxes of other dtypes, devices or ranks: {sorted(map(str, kinds))}; the plan was made for "
                "parameters of other dtypes than the module now has: plan again after changing the module's dtype"
            )
    return [list(bucket) for bucket in buckets]


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
