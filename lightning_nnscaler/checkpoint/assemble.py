"""The single-device state from the pieces of every rank file: model boxes, optimizer states, ZeRO chunks, tied keys.

Pieces are boxes of the full tensor (``((start, stop), ...)`` per dim) or, under ZeRO, chunk
``index`` of ``size`` elements of such a box flattened and zero-padded (``runtime.reducer``); a
file records each one's ``ir.box.PieceLocation`` in its plain form. Every piece is checked against
the metadata's shapes, so a file that disagrees is refused by name, not with an indexing error.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator

import torch

from lightning_nnscaler.checkpoint.integrity import CheckpointError
from lightning_nnscaler.ir.box import Box, PieceLocation, full_box, region


def _location(piece: dict[str, Any], shapes: dict[str, tuple[int, ...]], file: Path) -> PieceLocation:
    """The piece's location, checked to lie inside its tensor's full shape.

    Raises:
        CheckpointError: an unknown key, or a box outside the tensor.
    """
    try:
        location = PieceLocation.from_plain(piece)
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{file} holds a piece without a valid location ({error!r}): the file is damaged; load another checkpoint") from None
    shape = shapes.get(location.state_key)
    if shape is None:
        raise CheckpointError(f"{file} holds a piece of {location.state_key!r}, which the metadata does not list: the file is of another model")
    if len(location.box) != len(shape) or any(not 0 <= start <= stop <= size for (start, stop), size in zip(location.box, shape)):
        raise CheckpointError(
            f"{file} holds a piece {location.box} of {location.state_key!r}, outside its shape {list(shape)} in the metadata: "
            "the file is of another model or plan; load the checkpoint it belongs to"
        )
    return location


def assemble_model_state(metadata: dict[str, Any], rank_files: list[tuple[Path, dict[str, Any]]], path: Path) -> dict[str, torch.Tensor]:
    """The full state_dict from the saved pieces; tied keys share one tensor, as in the module.

    Raises:
        CheckpointError: a piece of the wrong shape, or an element of some tensor in no piece.
    """
    shapes = {key: tuple(shape) for key, shape in metadata["shapes"].items()}
    state: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for file, payload in rank_files:
        for piece in payload["model"]:
            location = _location(piece, shapes, file)
            key, value = location.state_key, _checked_value(piece, location, file)
            if key not in state:
                state[key] = torch.empty(shapes[key], dtype=getattr(torch, metadata["dtypes"][key]))
                covered[key] = torch.zeros(shapes[key], dtype=torch.bool)
            state[key][location.region()] = value
            covered[key][location.region()] = True
    for group in metadata["tied"]:
        source = next((key for key in group if key in state), None)
        for key in group:
            if source is not None and key not in state:
                state[key], covered[key] = state[source], covered[source]
    for key in metadata["state_keys"]:
        if key not in covered or not bool(covered[key].all()):
            raise CheckpointError(f"{path}: the rank files do not hold all of {key!r}; the checkpoint is damaged, load another")
    return {key: state[key] for key in metadata["state_keys"]}


def _checked_value(piece: dict[str, Any], location: PieceLocation, file: Path) -> torch.Tensor:
    """The piece's tensor, checked to have its location's shape.

    Raises:
        CheckpointError: not a tensor, or of another shape.
    """
    value = piece.get("value")
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != location.shape:
        found = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise CheckpointError(
            f"{file}: the piece {location.box} of {location.state_key!r} is {found}, not {list(location.shape)}: the file is damaged; load another checkpoint"
        )
    return value


def stream_model_state(metadata: dict[str, Any], rank_files: list[tuple[Path, dict[str, Any]]], path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The full state_dict as ``(key, tensor)`` in key order, one tensor assembled at a time (``ckpt merge --format safetensors``).

    Only the pieces' locations are indexed up front; a tensor is put together when its turn comes, so
    with memory-mapped rank files the memory held is one tensor (and its coverage mask). A tensor one
    piece holds whole is yielded as it lies in the file, a view of the mapping: copy what you keep.
    A tied key is yielded again, from its group's pieces.

    Raises:
        CheckpointError: a piece of the wrong shape, or an element of some tensor in no piece (raised when its turn comes).
    """
    shapes = {key: tuple(shape) for key, shape in metadata["shapes"].items()}
    pieces: dict[str, list[tuple[PieceLocation, torch.Tensor]]] = defaultdict(list)
    for file, payload in rank_files:
        for piece in payload["model"]:
            location = _location(piece, shapes, file)
            pieces[location.state_key].append((location, _checked_value(piece, location, file)))
    source = {key: next((tied for tied in group if tied in pieces), key) for group in metadata["tied"] for key in group}
    for key in metadata["state_keys"]:
        dtype = getattr(torch, metadata["dtypes"][key])
        yield key, _one_tensor(pieces.get(source.get(key, key), []), shapes[key], dtype, f"{path}: the rank files do not hold all of {key!r}")


def _one_tensor(pieces: list[tuple[PieceLocation, torch.Tensor]], shape: tuple[int, ...], dtype: torch.dtype, missing: str) -> torch.Tensor:
    """One full tensor from its pieces (boxes): the piece itself when one covers it all, else a new tensor filled piece by piece."""
    whole = next((value for location, value in pieces if location.box == full_box(shape) and location.chunk is None), None)
    if whole is not None:
        return whole.to(dtype)
    tensor, covered = torch.empty(shape, dtype=dtype), torch.zeros(shape, dtype=torch.bool)
    for location, value in pieces:
        tensor[location.region()] = value
        covered[location.region()] = True
    if not bool(covered.all()):
        raise CheckpointError(f"{missing}; the checkpoint is damaged, load another")
    return tensor


def full_optimizer_state(
    saved: dict[str, Any], group_keys: list[list[str]], per_rank: list[tuple[Path, list[dict[str, Any]]]], shapes: dict[str, tuple[int, ...]]
) -> dict[str, Any]:
    """A single-device ``optimizer.state_dict()``: ``saved`` holds the param groups' hyperparameters
    (``params`` are indices in key order); ``per_rank`` each rank file's pieces' states."""
    by_key: dict[str, list[tuple[PieceLocation, dict[str, Any]]]] = defaultdict(list)
    for file, pieces in per_rank:
        for piece in pieces:
            location = _location(piece, shapes, file)
            by_key[location.state_key].append((location, piece["state"]))
    state, index = {}, 0
    for keys in group_keys:
        for key in keys:
            if by_key.get(key):
                state[index] = _assemble(by_key[key], shapes[key], key)
            index += 1
    return {"state": state, "param_groups": saved["param_groups"]}


def _assemble(entries: list[tuple[PieceLocation, dict[str, Any]]], shape: tuple[int, ...], key: str) -> dict[str, Any]:
    """One parameter's optimizer state from its pieces' states: elementwise tensors (shaped like their
    piece) are put together; the rest (e.g. AdamW's ``step``, equal on every piece) taken from the first."""
    result = {}
    first_location, first_state = entries[0]
    for name, sample in first_state.items():
        if not _is_elementwise(sample, first_location):
            result[name] = sample.clone() if isinstance(sample, torch.Tensor) else sample  # not a view of the mapped file
            continue
        full = torch.zeros(shape, dtype=sample.dtype)
        chunks: dict[Box, dict[int, torch.Tensor]] = defaultdict(dict)
        for location, values in entries:
            if location.chunk is None:
                full[location.region()] = values[name]
            else:
                chunks[location.box][location.chunk[0]] = values[name]
        for box, by_index in chunks.items():  # ZeRO: a box's chunks, in index order, make the box
            target = full[region(box)]
            flat = torch.cat([by_index[chunk_index].reshape(-1) for chunk_index in sorted(by_index)])
            if flat.numel() < math.prod(target.shape):
                raise CheckpointError(f"the optimizer state {name!r} of {key!r} lacks ZeRO chunks of box {box}: the checkpoint is damaged, load another")
            target.copy_(flat[: math.prod(target.shape)].reshape(target.shape))
        result[name] = full
    return result


def _is_elementwise(value: Any, location: PieceLocation) -> bool:
    """An optimizer state tensor with one entry per element of the piece (Adam's moments, not its step)."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return False
    return tuple(value.shape) == location.shape
