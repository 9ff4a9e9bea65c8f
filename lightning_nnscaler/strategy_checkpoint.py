"""The full model and optimizer state ``NnScalerStrategy`` assembles from every rank's pieces.

The full LightningModule is refreshed from the pieces (``copy_pieces_into``) before evaluation
loops, at the end of training and for checkpoints, whose optimizer state is assembled likewise.

Every rank's optimizer holds state for its pieces only (boxes, or ZeRO chunks). For a checkpoint,
the pieces' states are gathered and assembled into the ``state_dict`` that a single-device
optimizer over the whole LightningModule would have (same param groups, same parameter order).
So a checkpoint saved under any recipe and world size is an ordinary Lightning checkpoint: it
loads with ``strategy="auto"``, and ``trainer.fit(ckpt_path=...)`` under another recipe or world
size reshards it (``strategy_gradients.move_param_groups`` cuts it into that plan's pieces).

Every rank assembles the whole state (memory of a full optimizer state per rank, for the moment
of saving); a sharded checkpoint format is left for later.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Callable

import torch

from lightning_nnscaler.strategy_gradients import PieceOf

def copy_pieces_into(module: torch.nn.Module, gathered: list[list[tuple[str, Any, torch.Tensor]]]) -> None:
    """Write every rank's ``(state_dict key, box, values)`` pieces into ``module``'s parameters and buffers."""
    targets = {**dict(module.named_parameters(remove_duplicate=False)), **dict(module.named_buffers(remove_duplicate=False))}
    with torch.no_grad():
        for pieces in gathered:
            for state_key, box, values in pieces:
                targets[state_key][tuple(slice(start, stop) for start, stop in box)].copy_(values)


# (where the piece lies, its shape, its optimizer state with tensors on the CPU)
_PieceState = tuple[PieceOf, tuple[int, ...], dict[str, Any]]


def full_optimizer_state(
    optimizer: torch.optim.Optimizer,
    group_keys: list[list[str]],
    locations: dict[int, PieceOf],
    shapes: dict[str, torch.Size],
    gather: Callable[[list[_PieceState]], list[list[_PieceState]]],
) -> dict[str, Any]:
    """The single-device ``optimizer.state_dict()`` of the whole model, from every rank's pieces.

    Args:
        optimizer: This rank's optimizer (over its pieces).
        group_keys: Per param group, the state_dict keys of its full parameters in order
            (what ``move_param_groups`` returned).
        locations: ``piece_locations`` of this rank's executor.
        shapes: Full parameter shapes by state_dict key.
        gather: Collects every rank's list (a collective: all ranks call it).
    """
    local = [
        (locations[id(piece)], tuple(piece.shape), {name: _to_cpu(value) for name, value in optimizer.state[piece].items()})
        for group in optimizer.param_groups
        for piece in group["params"]
        if optimizer.state.get(piece)
    ]
    by_key: dict[str, list[_PieceState]] = defaultdict(list)
    for rank_states in gather(local):
        for entry in rank_states:
            by_key[entry[0].state_key].append(entry)
    state, param_groups, index = {}, [], 0
    for group, keys in zip(optimizer.param_groups, group_keys):
        indices = []
        for key in keys:
            if by_key.get(key):
                state[index] = _assemble(by_key[key], shapes[key])
            indices.append(index)
            index += 1
        param_groups.append({**{name: value for name, value in group.items() if name != "params"}, "params": indices})
    return {"state": state, "param_groups": param_groups}


def _to_cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


def _assemble(entries: list[_PieceState], shape: torch.Size) -> dict[str, Any]:
    """One parameter's state: elementwise tensors (shaped like their piece) put together, the rest
    (e.g. AdamW's ``step``, equal on every piece) taken from the first piece."""
    result = {}
    for name, sample in entries[0][2].items():
        if not (isinstance(sample, torch.Tensor) and sample.dim() and tuple(sample.shape) == entries[0][1]):
            result[name] = sample
            continue
        full = torch.zeros(shape, dtype=sample.dtype)
        chunks: dict[tuple, dict[int, torch.Tensor]] = defaultdict(dict)
        for location, _, values in entries:
            region = tuple(slice(start, stop) for start, stop in location.box)
            if location.chunk is None:
                full[region] = values[name]
            else:
                chunks[location.box][location.chunk[0]] = values[name]
        for box, by_index in chunks.items():  # ZeRO: the chunks of a box, in index order, make the box
            region = tuple(slice(start, stop) for start, stop in box)
            numel = math.prod(stop - start for start, stop in box)
            flat = torch.cat([by_index[index] for index in sorted(by_index)])
            full[region] = flat[:numel].reshape(full[region].shape)
        result[name] = full
    return result
