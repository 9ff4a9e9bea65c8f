"""Running one rank's generated module: holding its pieces, forward, backward, gradient sums.

The executor decides nothing: what each rank holds and which ranks sum which gradients come from
the materialized program; the generated module does the step itself.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Callable

import torch

from lightning_nnscaler.ir.box import Box, PieceLocation, full_box, region
from lightning_nnscaler.ir.randomness import RandomStream, set_stream
from lightning_nnscaler.runtime.comm import AsyncHandle, Communicator
from lightning_nnscaler.runtime.compiled import CompileOptions, compile_segments, compile_settings
from lightning_nnscaler.program import ActionKind
from lightning_nnscaler.runtime.pipeline import PipelineRun, StepHandlers, module_actions
from lightning_nnscaler.runtime.reducer import GradientReducer


@dataclass(frozen=True)
class Shard:
    """A box of a parameter (or buffer) that this rank holds, and its values."""

    location: PieceLocation
    tensor: torch.Tensor


@dataclass(frozen=True)
class Piece:
    """A tensor this rank's optimizer updates, and where it lies in its full parameter."""

    location: PieceLocation
    """A box of the parameter, or under ZeRO the chunk of one that this rank owns."""
    tensor: torch.nn.Parameter
    replicas: int
    """How many ranks hold this same piece (and, after backward, the same summed gradient)."""


class RankExecutor:
    """Holds rank ``rank``'s parameter and buffer boxes and runs its module's ``PROGRAM`` (``runtime.pipeline``).

    Args:
        module: The rank's generated module (see ``codegen.emit``).
        rank: This rank.
        state: The full model state (``state_dict`` keys -> tensors); only this rank's boxes are copied.
        constants: Values of the graph's lifted constants.
        communicator: The rank's communicator.
        device: Where the pieces live.
        input_offsets: Per batch input, the row of the whole batch where the inputs this rank is
            given start (its data-parallel replica's share); 0 when it is given the whole batch.
        share_parameters: A trainable parameter of ``state`` this rank holds whole, on ``device``, is
            held as that very tensor instead of a copy (no second copy of the weights; the
            optimizer steps the model's own parameters). Only for one executor per process over
            its own model (``NnScalerStrategy``): ranks run as threads must each copy. Never under
            ZeRO, whose boxes are freed and rebuilt.
        materialize: The values of a piece whose full tensor in ``state`` lies on the meta device (a module built
            under deferred init, ``lightning_nnscaler.init``): ``materialize(location, meta_tensor)``.
        compile: Run each segment function under ``torch.compile`` with these options (``runtime.compiled``);
            None runs the generated code eagerly.
    """

    def __init__(
        self,
        module: ModuleType,
        rank: int,
        state: dict[str, torch.Tensor],
        constants: dict[str, torch.Tensor],
        communicator: Communicator,
        device: torch.device | str = "cpu",
        input_offsets: dict[str, int] | None = None,
        share_parameters: bool = False,
        materialize: Callable[[PieceLocation, torch.Tensor], torch.Tensor] | None = None,
        compile: CompileOptions | None = None,
    ) -> None:
        if (module.RANK, module.WORLD_SIZE) != (rank, communicator.world_size):
            raise ValueError(
                f"the generated module is rank {module.RANK} of a {module.WORLD_SIZE}-rank plan, but it is being run as "
                f"rank {rank} of {communicator.world_size}; plan again with world_size={communicator.world_size}"
            )
        self.rank = rank
        self.communicator = communicator
        self.trace_actions = False
        """Time each action run (``executed_actions`` holds the times, else zeros)."""
        self.values: dict[str, torch.Tensor] = {}
        """The last step's ``VALUES`` (graph outputs besides the loss, e.g. logged values), whole, summed over the ranks (float64)."""
        self.executed_actions: list[tuple[str, float, float]] = []
        self.device = torch.device(device)
        self.compile = compile
        shared: set[int] = set()  # a tied parameter is shared once, its other keys copied (as without sharing)
        share = share_parameters and not getattr(module, "ZERO_STAGE", 0)
        def piece_of(location: PieceLocation, role: str) -> Shard:
            source = state[location.state_key]
            if source.is_meta:  # a module built on meta: this rank's piece alone is materialized
                if materialize is None:
                    raise ValueError(f"{location.state_key} lies on the meta device and no materialize function was given for its pieces")
                return _piece(location, role, source, self.device, values=materialize(location, source))
            shard = _piece(location, role, source, self.device, shared if share else None)
            if getattr(module, "ZERO_STAGE", 0) == 3 and shard.tensor.untyped_storage().data_ptr() == source.untyped_storage().data_ptr():
                shard.tensor.data = shard.tensor.detach().clone()  # ZeRO-3 frees a box's storage: never the module's own
            return shard

        self._load(module, constants, input_offsets, piece_of)
        by_location = {shard.location: shard.tensor for shard in self.shards.values()}
        replicated = [(by_location[PieceLocation(key, box)], ranks) for key, box, ranks in module.GRADIENT_GROUPS]
        self.reducer_buckets = [list(bucket) for bucket in module.BUCKETS]
        """The buckets the reducer sums (and, under ZeRO-3, gathers): those of the plan this executor was made for."""
        self.reducer = GradientReducer(
            replicated, communicator, rank, module.ZERO_STAGE, buckets=[list(bucket) for bucket in module.BUCKETS],
            reduce_when_accumulated=not getattr(module, "PIPELINED", False),
        )

    def _load(
        self, module: ModuleType, constants: dict[str, torch.Tensor], input_offsets: dict[str, int] | None,
        piece_of: Callable[[PieceLocation, str], Shard],
    ) -> None:
        """Take ``module``'s table of held inputs: batch boxes, constants, and parameter/buffer pieces from ``piece_of``."""
        self.module = module
        self.actions = module_actions(module)
        module.DEVICE = self.device
        self.segments = None if self.compile is None else compile_segments(module, self.compile)
        """The segment functions run (compiled), or None: the module's own ``SEGMENTS``."""
        self.communicator.create_groups(module.GROUPS)
        self.held: dict[str, torch.Tensor] = {}
        self.input_boxes: dict[str, tuple[str, Box]] = {}
        self.shards: dict[str, Shard] = {}
        self.constant_vars: dict[str, list[str]] = {}
        for var, (name, state_key, box, role) in module.HELD.items():
            if role == "input":  # rows counted from the first row this rank's replica loads
                offset = (input_offsets or {}).get(name, 0)
                self.input_boxes[var] = (name, ((box[0][0] - offset, box[0][1] - offset), *box[1:]) if offset else box)
            elif role == "constant":
                self.held[var] = constants[name][region(box)].to(self.device)
                self.constant_vars.setdefault(name, []).append(var)
            else:
                shard = piece_of(PieceLocation(state_key, box), role)
                self.held[var], self.shards[var] = shard.tensor, shard

    def set_constants(self, values: dict[str, int | float]) -> None:
        """Set the graph constants named in ``values`` (the per-step quantities a step's lifted arithmetic reads)."""
        for name, value in values.items():
            for var in self.constant_vars.get(name, ()):
                self.held[var].fill_(value)

    def sharing_pieces(
        self, module: ModuleType, constants: dict[str, torch.Tensor], input_offsets: dict[str, int] | None = None
    ) -> RankExecutor:
        """An executor of ``module`` — this rank's code planned for another batch shape — over this
        executor's parameter and buffer pieces (the same tensors), reducer and communicator, so an
        optimizer stepping these pieces trains the model whichever plan ran the step.

        Raises:
            ValueError: ``module`` holds other pieces, sums other gradient groups or uses another ZeRO stage.
        """
        mine = {(key, box, role) for _, key, box, role in self.module.HELD.values() if role not in ("input", "constant")}
        theirs = {(key, box, role) for _, key, box, role in module.HELD.values() if role not in ("input", "constant")}
        if mine != theirs or module.GRADIENT_GROUPS != self.module.GRADIENT_GROUPS or module.ZERO_STAGE != self.module.ZERO_STAGE:
            raise ValueError(
                f"rank {self.rank}: the new plan holds other parameter pieces (only in it: {sorted(theirs - mine)[:4]}, "
                f"only in the first: {sorted(mine - theirs)[:4]}) or sums other gradient groups"
            )
        sibling = copy.copy(self)  # rank, device, communicator and reducer are shared
        by_location = {shard.location: shard for shard in self.shards.values()}
        sibling._load(module, constants, input_offsets, lambda location, role: by_location[location])
        return sibling

    @property
    def gathers_by_program(self) -> bool:
        """ZeRO-3: this executor's program gathers and frees the reducer's buckets itself (its ``BUCKETS`` are the
        reducer's, as for a sibling planned with the same per-layer stages), so a forward-only run need not gather
        every box first."""
        return self.reducer.zero_stage == 3 and [list(bucket) for bucket in self.module.BUCKETS] == self.reducer_buckets

    def parameters(self) -> list[torch.nn.Parameter]:
        """What this rank's optimizer updates: its parameter boxes (owned chunks of them under ZeRO)."""
        boxes = [shard.tensor for shard in self.shards.values() if isinstance(shard.tensor, torch.nn.Parameter)]
        return self.reducer.optimizer_parameters(boxes)

    def pieces(self) -> list[Piece]:
        """What this rank's optimizer updates (``parameters()``), each with its place in the full model."""
        replicas = {PieceLocation(key, box): len(ranks) for key, box, ranks in self.module.GRADIENT_GROUPS}
        by_tensor = {id(shard.tensor): shard for shard in self.shards.values()}
        chunks = {id(owned.chunk): owned for owned in self.reducer.owned}
        pieces = []
        for tensor in self.parameters():
            if id(tensor) in chunks:
                owned = chunks[id(tensor)]
                location = replace(by_tensor[id(owned.box)].location, chunk=(owned.ranks.index(self.rank), tensor.numel()))
                pieces.append(Piece(location, tensor, 1))
            else:
                location = by_tensor[id(tensor)].location
                pieces.append(Piece(location, tensor, replicas.get(location, 1)))
        return pieces

    def after_optimizer_step(self) -> None:
        """Call after ``optimizer.step()``: the program's actions after ``STEP`` (ZeRO-1 gathers the updated boxes,
        ZeRO-3 frees them), recorded after ``STEP`` in ``executed_actions``."""
        step = next((index for index, action in enumerate(self.actions) if action.kind is ActionKind.STEP), len(self.actions))
        self.executed_actions.append(("STEP", 0.0, 0.0))
        for action in self.actions[step + 1 :]:
            self.executed_actions.append((str(action), 0.0, 0.0))
            if action.kind is ActionKind.GATHER:
                self.reducer.gather_bucket(action.bucket)
            elif action.kind is ActionKind.FREE:
                self.reducer.release_bucket(action.bucket)

    def gradients(self) -> dict[str, tuple[str, Box, torch.Tensor]]:
        """This rank's summed parameter gradients by variable: (state_dict key, box, gradient)."""
        gathered = self.reducer.gathered_gradients() if self.reducer.zero_stage else {}
        result = {}
        for var, shard in self.shards.items():
            grad = gathered.get(id(shard.tensor), shard.tensor.grad)
            if isinstance(shard.tensor, torch.nn.Parameter) and grad is not None:
                result[var] = (shard.location.state_key, shard.location.box, grad.detach().clone())
        return result

    def full_shards(self) -> dict[str, Shard]:
        """This rank's boxes with their current values (under ZeRO-3, gathered for the occasion)."""
        if self.reducer.zero_stage == 3:
            self.reducer.gather_boxes()
        shards = {var: Shard(shard.location, shard.tensor.detach().clone()) for var, shard in self.shards.items()}
        if self.reducer.zero_stage == 3:
            self.reducer.release_boxes()
        return shards

    def forward_backward(
        self, inputs: dict[str, torch.Tensor], *, backward: bool = True, loss_scale: float | torch.Tensor = 1.0, reduce_gradients: bool = True,
        random_stream: RandomStream = RandomStream(),
    ) -> torch.Tensor:
        """One step's forward and backward on this rank; returns the whole loss (same on every rank).

        Runs the module's ``PROGRAM`` up to ``STEP`` (``runtime.pipeline``; the actions after it run in
        ``after_optimizer_step``). Gradients accumulate into the pieces' ``.grad`` as in torch. The whole
        loss is summed over the ranks at the program's ``LOSS``: while backward runs (an asynchronous sum
        started after the forward, waited for at the end), or in a pipeline after its last action.

        Args:
            inputs: The batch by graph input name (the rank's replica's share, see ``input_offsets``);
                each rank slices the box it needs.
            backward: False to run forward only (evaluation).
            loss_scale: The gradients are those of ``loss * loss_scale`` (Lightning divides the loss
                by ``accumulate_grad_batches``; fp16 loss scaling multiplies it by a scale tensor,
                passed as a tensor so that reading it never waits for the device).
            reduce_gradients: False keeps the replicated gradients local (DDP's ``no_sync``, for all
                but the last batch of an accumulation window); the next reducing step sums them.
            random_stream: The (seed, step, draw) the step's random ops (dropout masks) draw from:
                set for the process before the step runs (``ir.randomness``).
        """
        set_stream(random_stream)
        held = dict(self.held)
        for var, (name, box) in self.input_boxes.items():
            held[var] = inputs[name][region(box)].to(self.device)
        parameters = [shard.tensor for shard in self.shards.values() if isinstance(shard.tensor, torch.nn.Parameter)]
        run = PipelineRun(self.module, self.rank, self.communicator, held, parameters, self.device, trace=self.trace_actions, segments=self.segments)
        if backward:
            self.reducer.before_backward(False)  # accumulate over the microbatches; sum during the last backward
        loss_sum: list[AsyncHandle] = []
        settled = [False]

        def start_loss_sum() -> None:
            # A pipeline (decided for the whole plan, so every rank agrees) starts it once its messages and gradient
            # sums are done: a collective in flight beside the stages' point-to-point messages could be ordered
            # differently on each rank (NCCL). Other plans overlap it with backward.
            if self.module.PIPELINED and not settled[0]:
                self._settle(backward)
                settled[0] = True
            loss_sum.append(self._start_loss_sum(run.seeds, run.values))

        handlers = StepHandlers(
            loss=start_loss_sum, reduce=self.reducer.start_through, gather=self.reducer.gather_bucket, free=self.reducer.release_bucket,
            before_last_backward=(lambda: self.reducer.before_backward(reduce_gradients)) if backward else None,
        )
        self.reducer.on_bucket_started = lambda order: run.record(f"REDUCE b{order}")
        try:
            with contextlib.nullcontext() if self.segments is None else compile_settings(self.module):
                run.run(self.actions, backward=backward, loss_scale=loss_scale, handlers=handlers)
        finally:
            self.reducer.on_bucket_started = None
        if backward:
            self._write_buffers(run.buffer_values)
        if not settled[0]:
            self._settle(backward)
        self.executed_actions = run.executed
        return loss_sum[0].wait()

    def _settle(self, backward: bool) -> None:
        """Wait for the step's sends; after a backward, finish the gradient sums (``GradientReducer.after_backward``)."""
        self.communicator.wait_sends()
        if backward:
            self.reducer.after_backward()

    def whole_buffers(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        """A copy of each buffer of ``shapes`` (state_dict key -> its shape) that this rank holds whole."""
        return {
            shard.location.state_key: shard.tensor.detach().clone() for shard in self.shards.values()
            if shard.location.state_key in shapes and not isinstance(shard.tensor, torch.nn.Parameter)
            and shard.location.chunk is None and shard.location.box == full_box(shapes[shard.location.state_key])
        }

    def write_whole_buffers(self, values: dict[str, torch.Tensor]) -> None:
        """Write whole buffer values (by state_dict key) into the boxes this rank holds."""
        self._write_buffers([(key, full_box(value.shape), value) for key, value in values.items()])

    def _write_buffers(self, values: list[tuple[str, Box, torch.Tensor]]) -> None:
        """Write the step's new buffer values (``BUFFER_PIECES``) into the buffer boxes this rank holds: each
        rank keeps its own replica's values, as each ddp rank updates its own copy from its own rows."""
        if not values:
            return
        held = [shard for shard in self.shards.values() if not isinstance(shard.tensor, torch.nn.Parameter)]
        with torch.no_grad():
            for key, box, value in values:
                for shard in held:
                    if shard.location.state_key == key:
                        _copy_overlap(shard.tensor, shard.location.box, value, box)

    def _start_loss_sum(self, seeds: list[torch.Tensor], values: list[tuple[str, Box, torch.Tensor]] = ()) -> AsyncHandle:
        """Start summing every rank's seeded (value-part or whole) scalar loss pieces; ``.wait()`` gives the loss.

        With ``VALUES`` (graph outputs besides the loss: logged values), their counted pieces ``values``
        are summed in the same collective (in float64); ``.wait()`` also sets ``self.values``.
        """
        local = sum((seed.detach().reshape(()) for seed in seeds if seed.numel() == 1), torch.zeros((), device=self.device))
        ranks = tuple(range(self.communicator.world_size))
        shapes: dict[str, tuple[int, ...]] = getattr(self.module, "VALUES", {})
        if not shapes:
            # Started before any gradient bucket, on every rank: the async sums pair up (see runtime.comm).
            return self._sum_over(local, ranks)
        wholes = {name: torch.zeros(shape, dtype=torch.float64, device=self.device) for name, shape in shapes.items()}
        for name, box, piece in values:
            wholes[name][region(box)] += piece.detach().to(torch.float64)
        flat = torch.cat([local.detach().to(torch.float64).reshape(1)] + [whole.reshape(-1) for whole in wholes.values()])
        return _SplitSums(self._sum_over(flat, ranks), local.dtype, shapes, self)

    def _sum_over(self, tensor: torch.Tensor, ranks: tuple[int, ...]) -> AsyncHandle:
        """An async sum over ``ranks``; alone in the world, the tensor itself (no collective, no wait on the device)."""
        return self.communicator.all_reduce_async(tensor, ranks) if len(ranks) > 1 else _Summed(tensor)


class _Summed:
    """A sum over one rank: already done."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def wait(self) -> torch.Tensor:
        return self.tensor


class _SplitSums:
    """The loss-and-values sum in flight: ``wait()`` gives the loss and sets the executor's ``values``."""

    def __init__(self, handle: AsyncHandle, loss_dtype: torch.dtype, shapes: dict[str, tuple[int, ...]], executor: RankExecutor) -> None:
        self.handle, self.loss_dtype, self.shapes, self.executor = handle, loss_dtype, shapes, executor

    def wait(self) -> torch.Tensor:
        """The whole loss (the values land in ``executor.values``)."""
        flat = self.handle.wait()
        offset = 1
        values = {}
        for name, shape in self.shapes.items():
            count = math.prod(shape)
            values[name] = flat[offset : offset + count].reshape(shape)
            offset += count
        self.executor.values = values
        return flat[0].to(self.loss_dtype)


def _piece(
    location: PieceLocation, role: str, source: torch.Tensor, device: torch.device, shared: set[int] | None = None,
    values: torch.Tensor | None = None,
) -> Shard:
    """This rank's own copy of ``location`` of ``source`` (a Parameter when it is a trained parameter);
    with ``shared`` (the ids of the sources shared so far), a trained parameter held whole on its
    device is ``source`` itself. ``values``: the piece's values, given (``source`` on meta)."""
    whole = location.chunk is None and location.shape == tuple(source.shape) and source.device == device
    if shared is not None and role == "parameter" and isinstance(source, torch.nn.Parameter) and source.requires_grad and whole:
        if id(source) not in shared:
            shared.add(id(source))
            return Shard(location, source)
    piece = (location.take(source.detach()) if values is None else values).to(device=device, dtype=source.dtype)
    if role == "parameter" and source.requires_grad:
        piece = torch.nn.Parameter(piece)
    return Shard(location, piece)


def _copy_overlap(target: torch.Tensor, target_box: Box, source: torch.Tensor, source_box: Box) -> None:
    """Copy the elements ``source`` (box ``source_box`` of a tensor) shares with ``target`` (box ``target_box``)."""
    common = [(max(a[0], b[0]), min(a[1], b[1])) for a, b in zip(target_box, source_box)]
    if any(start >= stop for start, stop in common):
        return
    into = tuple(slice(start - low, stop - low) for (start, stop), (low, _) in zip(common, target_box))
    out_of = tuple(slice(start - low, stop - low) for (start, stop), (low, _) in zip(common, source_box))
    target[into].copy_(source[out_of])


def merge_shards(per_rank: list[dict[str, Shard]], shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Whole tensors (by state_dict key) from every rank's shards."""
    merged: dict[str, torch.Tensor] = {}
    for shards in per_rank:
        for shard in shards.values():
            key = shard.location.state_key
            whole = merged.setdefault(key, torch.zeros(shapes[key], dtype=shard.tensor.dtype))
            whole[shard.location.region()] = shard.tensor.detach().cpu()
    return merged


def merge_gradients(per_rank: list[dict[str, tuple[str, Box, torch.Tensor]]], shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Whole gradients (by state_dict key) from every rank's ``RankExecutor.gradients()``."""
    merged: dict[str, torch.Tensor] = {}
    for gradients in per_rank:
        for state_key, box, grad in gradients.values():
            whole = merged.setdefault(state_key, torch.zeros(shapes[state_key], dtype=grad.dtype))
            whole[region(box)] = grad.cpu()
    return merged
