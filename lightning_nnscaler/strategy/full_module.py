"""The LightningModule filled with the plan's current weights, one piece at a time.

After a fit (and before an evaluation the plan cannot run) the user's module must hold the trained
weights. Every rank knows only its own pieces: boxes of parameters and buffers, or under ZeRO the
flat chunks of them its optimizer steps. Each distinct piece is broadcast by the lowest rank holding
it and written into the module's tensor on every rank, so no rank holds more than one piece beyond
the module itself (no gathering of every rank's pieces at once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from lightning_nnscaler.checkpoint import read_pieces
from lightning_nnscaler.ir.box import PieceLocation
from lightning_nnscaler.runtime.executor import RankExecutor


@dataclass(frozen=True)
class HeldPiece:
    """What a rank says about a piece it holds: where it lies, its dtype, and whether it is the module's own tensor."""

    location: PieceLocation
    dtype: torch.dtype
    module_tensor: bool


def held_pieces(executor: RankExecutor) -> list[tuple[PieceLocation, torch.Tensor]]:
    """This rank's current pieces: what its optimizer steps (chunks under ZeRO), then its buffer boxes."""
    parameters = [(piece.location, piece.tensor) for piece in executor.pieces()]
    buffers = [(shard.location, shard.tensor) for shard in executor.shards.values() if not isinstance(shard.tensor, nn.Parameter)]
    return parameters + buffers


def fill_module(
    module: nn.Module, held: list[tuple[PieceLocation, torch.Tensor]], rank: int, world_size: int,
    gather_objects: Callable[[object], list], broadcast: Callable[[torch.Tensor, int], None],
) -> None:
    """Write every rank's pieces into ``module`` (a collective: every rank calls it with its own ``held``).

    A piece every rank holds as the module's own tensor is current already and skipped. A buffer a
    step writes per data-parallel replica (BatchNorm's running statistics) ends with this rank's own
    values, as a ddp rank keeps its own copy.
    """
    targets = {**dict(module.named_parameters(remove_duplicate=False)), **dict(module.named_buffers(remove_duplicate=False))}
    own_ids = {id(tensor) for tensor in targets.values()}
    said = [HeldPiece(location, tensor.dtype, id(tensor) in own_ids) for location, tensor in held]
    by_rank: list[list[HeldPiece]] = gather_objects(said)
    owners: dict[PieceLocation, tuple[int, torch.dtype]] = {}
    holders: dict[PieceLocation, list[bool]] = {}
    for holder_rank, pieces in enumerate(by_rank):
        for piece in pieces:
            owners.setdefault(piece.location, (holder_rank, piece.dtype))
            holders.setdefault(piece.location, []).append(piece.module_tensor)
    mine = dict(held)
    with torch.no_grad():
        for location, (owner, dtype) in owners.items():
            if len(holders[location]) == world_size and all(holders[location]):
                continue
            target = targets[location.state_key]
            if owner == rank:  # contiguous: a piece may be a view of a larger tensor
                values = mine[location].detach().contiguous()
            else:
                values = torch.empty(location.shape, dtype=dtype, device=target.device)
            broadcast(values, owner)
            write_piece(target, location, values)
        for location, tensor in held:
            if not isinstance(tensor, nn.Parameter) and location in mine and location.chunk is None:
                write_piece(targets[location.state_key], location, tensor.detach())


def gather_state(
    module: nn.Module, held: list[tuple[PieceLocation, torch.Tensor]], rank: int, to: int,
    gather_objects: Callable[[object], list], broadcast: Callable[[torch.Tensor, int], None],
    materialize: Callable[[str, torch.Tensor], torch.Tensor],
) -> dict[str, torch.Tensor]:
    """The whole current state_dict of ``module`` on rank ``to`` (on the CPU; empty on the other ranks), built one piece
    at a time (a collective). A piece ``to`` holds is its own; each other is broadcast by the lowest rank holding it.
    A tensor no rank holds a piece of is ``module``'s own value (``materialize(key, tensor)`` where it lies on meta)."""
    by_rank: list[list[HeldPiece]] = gather_objects([HeldPiece(location, tensor.dtype, False) for location, tensor in held])
    holders: dict[PieceLocation, list[int]] = {}
    dtypes: dict[PieceLocation, torch.dtype] = {}
    for holder_rank, pieces in enumerate(by_rank):
        for piece in pieces:
            holders.setdefault(piece.location, []).append(holder_rank)
            dtypes.setdefault(piece.location, piece.dtype)
    state = module.state_dict(keep_vars=True)
    result: dict[str, torch.Tensor] = {}
    mine = dict(held)
    with torch.no_grad():
        for location, ranks in holders.items():
            owner = to if to in ranks else ranks[0]
            if owner != to:
                if owner == rank:  # contiguous: a piece may be a view of a larger tensor
                    values = mine[location].detach().contiguous()
                else:
                    values = torch.empty(location.shape, dtype=dtypes[location], device=_device(held))
                broadcast(values, owner)
            else:
                values = mine[location].detach() if rank == to else None
            if rank == to:
                full = result.setdefault(location.state_key, torch.empty(state[location.state_key].shape, dtype=dtypes[location]))
                write_piece(full, location, values.cpu())
    if rank != to:
        return {}
    tensors: dict[int, torch.Tensor] = {}
    for key, tensor in state.items():  # tied keys share one tensor, as in the module
        whole = result.get(key)
        if whole is None:
            whole = materialize(key, tensor) if tensor.is_meta else tensor.detach()
        result[key] = tensors.setdefault(id(tensor), whole.cpu())
    return {key: result[key] for key in state}


def assign_state_dict(module: nn.Module, state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> None:
    """Load ``state_dict`` into ``module`` (on meta) by taking its tensors as the module's own; keys that name one
    tensor in ``module`` (tied weights) name one tensor after."""
    groups: dict[int, list[str]] = {}
    for key, tensor in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        groups.setdefault(id(tensor), []).append(key)
    module.load_state_dict(state_dict, strict=strict, assign=True)
    for keys in groups.values():
        first = _tensor_at(module, keys[0])
        for key in keys[1:]:
            owner_path, _, name = key.rpartition(".")
            owner = module.get_submodule(owner_path) if owner_path else module
            table = owner._parameters if name in owner._parameters else owner._buffers
            table[name] = first


def _tensor_at(module: nn.Module, key: str) -> torch.Tensor:
    owner_path, _, name = key.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    return owner._parameters[name] if name in owner._parameters else owner._buffers[name]


def _device(held: list[tuple[PieceLocation, torch.Tensor]]) -> torch.device:
    return held[0][1].device if held else torch.device("cpu")


def write_piece(target: torch.Tensor, location: PieceLocation, values: torch.Tensor) -> None:
    """Copy ``values`` (a box, or a zero-padded flat chunk of one) into its place in the full ``target``."""
    box = target[location.region()]
    if location.chunk is None:
        box.copy_(values)
        return
    index, size = location.chunk
    flat = box.reshape(-1).clone()
    start = index * size
    count = max(0, min(size, flat.numel() - start))
    flat[start : start + count] = values[:count].to(flat.dtype)
    box.copy_(flat.view(box.shape))


def restore_pieces(
    path: str, module: nn.Module, executor: RankExecutor, optimizers: list[torch.optim.Optimizer] | None,
    locations: dict[int, PieceLocation],
) -> int:
    """Overwrite ``executor``'s pieces (and, given ``optimizers`` over its pieces, their state) with the sharded
    checkpoint at ``path``, reading only this rank's slices (``checkpoint.read_pieces``); returns the bytes read.

    Under ZeRO the replicated boxes are rebuilt from the owned chunks, which are what is read.
    """
    owned_boxes = {id(owned.box) for owned in executor.reducer.owned}
    shards = [shard for shard in executor.shards.values() if id(shard.tensor) not in owned_boxes]
    chunks = [piece for piece in executor.pieces() if piece.location.chunk is not None]
    model = list(dict.fromkeys([*(shard.location for shard in shards), *(piece.location for piece in chunks)]))
    wanted_states = None
    if optimizers is not None:
        wanted_states = [[locations[id(p)] for group in optimizer.param_groups for p in group["params"]] for optimizer in optimizers]
    shapes = {key: tuple(tensor.shape) for key, tensor in module.state_dict(keep_vars=True).items()}
    read = read_pieces(path, model, wanted_states, shapes=shapes)
    with torch.no_grad():
        for shard in shards:
            shard.tensor.copy_(read.model[shard.location])
        for piece in chunks:
            piece.tensor.copy_(read.model[piece.location])
    if executor.reducer.owned and executor.reducer.zero_stage == 1:
        executor.reducer.gather_boxes()  # the boxes from the chunks just read (ZeRO-3 gathers them when a step needs them)
    for optimizer, states in zip(optimizers or [], read.optimizers):
        for parameter in (p for group in optimizer.param_groups for p in group["params"]):
            state = states.get(locations[id(parameter)])
            if state is not None:
                optimizer.state[parameter] = {
                    name: value.to(parameter.device) if isinstance(value, torch.Tensor) and value.dim() else value for name, value in state.items()
                }
    return read.bytes_read
