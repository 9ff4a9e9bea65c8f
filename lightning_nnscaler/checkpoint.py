"""Sharded checkpoints: every rank writes its own pieces, atomically; any plan loads them.

A checkpoint is a directory (named like a Lightning checkpoint file, e.g. ``epoch=0-step=10.ckpt``)::

    rank00000-of-00002.pt   this rank's pieces: model boxes and optimizer state (one writer per piece)
    rank00001-of-00002.pt
    common.pt               everything else Lightning saves (loops, callbacks, LR schedulers, hparams,
                            optimizer hyperparameters), written by rank 0
    metadata.json           the plan (recipe, parameters, world size, code hash), the full shapes, each
                            optimizer's param-group keys, and every file's size: written last

Atomic: the files are written into a hidden sibling directory (``.<name>.partial-<token>``) that
nothing loads, each file itself written to a temporary name and renamed. Only when every rank has
written its file does rank 0 write ``metadata.json`` and swap the directory into place (an earlier
checkpoint of the same name is renamed away first, then removed). A run killed at any point leaves
either the earlier checkpoint or the new one, never a mix; a directory without ``metadata.json``
is refused with an error that says so.

Resharding: ``load`` assembles the single-device Lightning checkpoint (full ``state_dict``, each
optimizer's ``state_dict`` over the whole module) from all the rank files, whatever plan wrote
them; the strategy then cuts it into the new plan's pieces. ``merge`` writes that assembly as one
plain file which loads with ``strategy="auto"``. Every load is ``torch.load(weights_only=True)``.

Pieces are boxes of the full tensor (``((start, stop), ...)`` per dim) or, under ZeRO, chunk
``index`` of ``size`` elements of such a box flattened and zero-padded (``runtime.reducer``); a
file records each one's ``ir.box.PieceLocation`` in its plain form.
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from lightning_nnscaler.ir.box import Box, PieceLocation, region

FORMAT = "lightning-nnscaler-sharded"
VERSION = 1
METADATA = "metadata.json"
COMMON = "common.pt"


class CheckpointError(RuntimeError):
    """A checkpoint directory that is incomplete, of another format, or does not match its metadata."""


def rank_file_name(rank: int, world_size: int) -> str:
    """``rank00003-of-00008.pt``."""
    return f"rank{rank:05d}-of-{world_size:05d}.pt"


def partial_directory(path: str | os.PathLike, token: str) -> Path:
    """The hidden directory a checkpoint is written into before it is swapped into ``path``."""
    path = Path(path)
    return path.parent / f".{path.name}.partial-{token}"


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """True for a directory (finished or not) rather than a plain checkpoint file."""
    return Path(path).is_dir()


def write_atomically(payload: Any, path: Path) -> None:
    """``torch.save`` to a temporary name, flushed to disk, then renamed to ``path``."""
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "wb") as stream:
        torch.save(payload, stream)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(temporary, path)


def rank_payload(
    model_pieces: list[tuple[PieceLocation, torch.Tensor]],
    optimizer_pieces: list[list[tuple[PieceLocation, dict[str, Any]]]],
) -> dict[str, Any]:
    """What one rank's file holds: its model pieces, and per optimizer its pieces' states (tensors on the CPU)."""
    return {
        "model": [{**location.to_plain(), "value": _to_cpu(value)} for location, value in model_pieces],
        "optimizers": [
            [{**location.to_plain(), "state": {name: _to_cpu(value) for name, value in state.items()}} for location, state in pieces]
            for pieces in optimizer_pieces
        ],
    }


def commit(partial: Path, path: str | os.PathLike, metadata: dict[str, Any]) -> None:
    """Write ``metadata.json`` into the finished ``partial`` directory and swap it into ``path`` (rank 0 only)."""
    path = Path(path)
    files = sorted(child.name for child in partial.iterdir() if not child.name.startswith("."))
    metadata = {"format": FORMAT, "version": VERSION, **metadata, "files": {name: (partial / name).stat().st_size for name in files}}
    temporary = partial / f".{METADATA}.tmp"
    temporary.write_text(json.dumps(metadata, indent=1, sort_keys=True))
    os.replace(temporary, partial / METADATA)
    earlier = path.parent / f".{path.name}.replaced-{partial.name.rsplit('-', 1)[-1]}"
    if path.exists() or path.is_symlink():
        os.replace(path, earlier)
    os.replace(partial, path)
    if earlier.is_dir() and not earlier.is_symlink():
        shutil.rmtree(earlier)
    elif earlier.exists() or earlier.is_symlink():
        earlier.unlink()


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint's metadata, after checking the directory is complete.

    Raises:
        CheckpointError: no metadata (the save never finished), another format, or a file missing or of another size.
    """
    path = Path(path)
    metadata_path = path / METADATA
    if not metadata_path.exists():
        raise CheckpointError(
            f"{path} has no {METADATA}: it is not a finished lightning-nnscaler checkpoint (a save that was interrupted "
            "leaves no metadata). Load an earlier checkpoint."
        )
    metadata = json.loads(metadata_path.read_text())
    if metadata.get("format") != FORMAT or metadata.get("version") != VERSION:
        raise CheckpointError(f"{metadata_path} is format {metadata.get('format')!r} v{metadata.get('version')}; expected {FORMAT!r} v{VERSION}")
    for name, size in metadata["files"].items():
        actual = (path / name).stat().st_size if (path / name).exists() else None
        if actual != size:
            raise CheckpointError(f"{path / name} is {'missing' if actual is None else f'{actual} bytes'}; the metadata says {size} bytes")
    return metadata


def load(path: str | os.PathLike) -> dict[str, Any]:
    """The single-device Lightning checkpoint assembled from a sharded checkpoint directory.

    The result is what ``strategy="auto"`` would have saved: a full ``state_dict`` and each
    optimizer's ``state_dict`` over the whole module, with the saved param groups.

    Raises:
        CheckpointError: see ``read_metadata``.
    """
    path = Path(path)
    metadata = read_metadata(path)
    checkpoint = torch.load(path / COMMON, map_location="cpu", weights_only=True)
    rank_files = [torch.load(path / rank_file_name(rank, metadata["world_size"]), map_location="cpu", weights_only=True) for rank in range(metadata["world_size"])]
    shapes = {key: tuple(shape) for key, shape in metadata["shapes"].items()}
    state_dict = _assemble_model_state(metadata, [piece for rank_file in rank_files for piece in rank_file["model"]], path)
    checkpoint["state_dict"] = state_dict
    if "optimizer_states" in checkpoint:
        checkpoint["optimizer_states"] = [
            _full_optimizer_state(saved, metadata["param_group_keys"][index], [rank_file["optimizers"][index] for rank_file in rank_files], shapes)
            for index, saved in enumerate(checkpoint["optimizer_states"])
        ]
    return checkpoint


def _assemble_model_state(metadata: dict[str, Any], pieces: list[dict[str, Any]], path: Path) -> dict[str, torch.Tensor]:
    """The full state_dict from the saved pieces; tied keys share one tensor, as in the module.

    Raises:
        CheckpointError: an element of some tensor is in no piece.
    """
    shapes = {key: tuple(shape) for key, shape in metadata["shapes"].items()}
    state: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for piece in pieces:
        location = PieceLocation.from_plain(piece)
        key = location.state_key
        if key not in state:
            state[key] = torch.empty(shapes[key], dtype=getattr(torch, metadata["dtypes"][key]))
            covered[key] = torch.zeros(shapes[key], dtype=torch.bool)
        state[key][location.region()] = piece["value"]
        covered[key][location.region()] = True
    for group in metadata["tied"]:
        source = next((key for key in group if key in state), None)
        for key in group:
            if source is not None and key not in state:
                state[key], covered[key] = state[source], covered[source]
    for key in metadata["state_keys"]:
        if key not in covered or not bool(covered[key].all()):
            raise CheckpointError(f"{path}: the rank files do not hold all of {key!r}; the checkpoint is damaged")
    return {key: state[key] for key in metadata["state_keys"]}


def merge(path: str | os.PathLike, output: str | os.PathLike) -> None:
    """Write the sharded checkpoint at ``path`` as one plain Lightning checkpoint file ``output`` (atomically)."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(load(path), output)


def open_merged(path: str | os.PathLike) -> io.BytesIO:
    """The sharded checkpoint at ``path`` as an in-memory plain checkpoint file, for APIs that read
    one, e.g. ``MyModule.load_from_checkpoint(open_merged(path))``."""
    buffer = io.BytesIO()
    torch.save(load(path), buffer)
    buffer.seek(0)
    return buffer


def _full_optimizer_state(
    saved: dict[str, Any], group_keys: list[list[str]], per_rank: list[list[dict[str, Any]]], shapes: dict[str, tuple[int, ...]]
) -> dict[str, Any]:
    """A single-device ``optimizer.state_dict()``: ``saved`` holds the param groups' hyperparameters
    (``params`` are indices in key order); ``per_rank`` the pieces' states."""
    by_key: dict[str, list[tuple[PieceLocation, dict[str, Any]]]] = defaultdict(list)
    for pieces in per_rank:
        for piece in pieces:
            location = PieceLocation.from_plain(piece)
            by_key[location.state_key].append((location, piece["state"]))
    state, index = {}, 0
    for keys in group_keys:
        for key in keys:
            if by_key.get(key):
                state[index] = _assemble(by_key[key], shapes[key])
            index += 1
    return {"state": state, "param_groups": saved["param_groups"]}


def _assemble(entries: list[tuple[PieceLocation, dict[str, Any]]], shape: tuple[int, ...]) -> dict[str, Any]:
    """One parameter's optimizer state from its pieces' states: elementwise tensors (shaped like their
    piece) are put together; the rest (e.g. AdamW's ``step``, equal on every piece) taken from the first."""
    result = {}
    first_location, first_state = entries[0]
    for name, sample in first_state.items():
        if not _is_elementwise(sample, first_location):
            result[name] = sample
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
            flat = torch.cat([by_index[chunk_index] for chunk_index in sorted(by_index)])
            target.copy_(flat[: math.prod(target.shape)].reshape(target.shape))
        result[name] = full
    return result


def _is_elementwise(value: Any, location: PieceLocation) -> bool:
    """An optimizer state tensor with one entry per element of the piece (Adam's moments, not its step)."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return False
    return tuple(value.shape) == location.shape


def _to_cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value
