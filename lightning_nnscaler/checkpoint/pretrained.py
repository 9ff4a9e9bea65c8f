"""Pretrained weights read per slice: each rank reads only the boxes of the tensors it holds.

A source is a ``.safetensors`` file or a Hugging Face style directory: ``model.safetensors``; or
shards listed by ``model.safetensors.index.json``'s ``weight_map`` (any one ``*.safetensors.index.json``
is read the same way); or, without either, every ``*.safetensors`` file in it (a key in two of them is
refused). A box is read with ``safe_open(...).get_slice(key)[slices]``: the file is memory-mapped and
only the box's bytes are copied, so a rank holding a quarter of a tensor reads a quarter of its bytes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Mapping, NamedTuple, Optional

import torch
from safetensors import safe_open

from lightning_nnscaler.checkpoint.export import INDEX_FILE, SINGLE_FILE
from lightning_nnscaler.checkpoint.integrity import CheckpointError
from lightning_nnscaler.ir.box import Box, region

__all__ = ["SliceRead", "read_slices", "safetensors_files"]


class SliceRead(NamedTuple):
    """What ``read_slices`` returns (it unpacks as ``tensors, bytes_read``)."""

    tensors: dict[str, torch.Tensor]
    """Each wanted key's box (the whole tensor for a box of None), under the key it was asked by."""
    bytes_read: int
    """The bytes of the slices read: each box's element count times its stored element size."""


def read_slices(
    source: str | os.PathLike,
    wanted: Mapping[str, Optional[Box]],
    *,
    dtype: Optional[torch.dtype] = None,
    key_map: Optional[Callable[[str], str]] = None,
) -> SliceRead:
    """Read each ``wanted`` key's box (None: all of it) from the safetensors file or directory ``source``.

    Args:
        source: a ``.safetensors`` file or a directory holding them (see the module docstring).
        wanted: state key -> box, one ``(start, stop)`` per dim of the stored tensor.
        dtype: cast each slice to it after reading (the bytes read are the stored ones).
        key_map: the name a state key has in the files, e.g. ``lambda key: key.removeprefix("model.")``.

    Raises:
        CheckpointError: ``source`` holds no safetensors, a key is missing from it, or a box does not fit
            the stored shape; the message names the key, the file and what to do.
    """
    files = safetensors_files(source)
    stored_names = {key: key_map(key) if key_map else key for key in wanted}
    by_file: dict[Path, list[str]] = {}
    for key, name in stored_names.items():
        if name not in files:
            renamed = f" (stored name {name!r})" if name != key else ""
            raise CheckpointError(
                f"{key!r}{renamed} is not in {source} ({len(files)} tensors, e.g. {sorted(files)[:3]}): pass a key_map that "
                "turns state keys into the file's names, or load a checkpoint of this model"
            )
        by_file.setdefault(files[name], []).append(key)
    tensors: dict[str, torch.Tensor] = {}
    bytes_read = 0
    for file, keys in by_file.items():
        with safe_open(str(file), framework="pt", device="cpu") as opened:
            for key in keys:
                values = _read_box(opened, file, key, stored_names[key], wanted[key])
                bytes_read += values.numel() * values.element_size()
                tensors[key] = values if dtype is None else values.to(dtype)
    return SliceRead(tensors, bytes_read)


def safetensors_files(source: str | os.PathLike) -> dict[str, Path]:
    """Each stored tensor name of ``source`` -> the file that holds it (reads headers and the index only).

    Raises:
        CheckpointError: no such path, no safetensors in it, an index naming a missing file, a name in two files.
    """
    source = Path(source)
    if source.is_file():
        return {name: source for name in _names_in(source)}
    if not source.is_dir():
        raise CheckpointError(f"{source} does not exist: pass a .safetensors file or a directory holding model.safetensors or its shards")
    if (source / INDEX_FILE).is_file():
        return _from_index(source / INDEX_FILE)
    if (source / SINGLE_FILE).is_file():
        return {name: source / SINGLE_FILE for name in _names_in(source / SINGLE_FILE)}
    indexes = sorted(source.glob("*.safetensors.index.json"))
    if len(indexes) == 1:
        return _from_index(indexes[0])
    files: dict[str, Path] = {}
    for file in sorted(source.glob("*.safetensors")):
        for name in _names_in(file):
            if name in files:
                raise CheckpointError(
                    f"{name!r} is stored in both {files[name]} and {file}: keep one of them, or add an index json naming which to read"
                )
            files[name] = file
    if not files:
        raise CheckpointError(f"{source} holds no .safetensors file: pass the directory a save_pretrained or export_safetensors wrote")
    return files


def _from_index(index: Path) -> dict[str, Path]:
    """An index json's ``weight_map``, each shard file checked to exist."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{index} is not a safetensors index (a json with a weight_map): {error}; restore it or remove it") from error
    missing = sorted({shard for shard in weight_map.values() if not (index.parent / shard).is_file()})
    if missing:
        raise CheckpointError(f"{index} names shard(s) {missing} that are not in {index.parent}: download or copy them there")
    return {name: index.parent / shard for name, shard in weight_map.items()}


def _names_in(file: Path) -> list[str]:
    try:
        with safe_open(str(file), framework="pt", device="cpu") as opened:
            return list(opened.keys())
    except Exception as error:  # safetensors raises its own SafetensorError for a damaged header
        raise CheckpointError(f"{file} is not a readable safetensors file ({error}): download or export it again") from error


def _read_box(opened: object, file: Path, key: str, name: str, box: Optional[Box]) -> torch.Tensor:
    """One box of the stored tensor ``name``, checked against its shape; only the box's bytes are copied."""
    if box is None:
        return opened.get_tensor(name)  # type: ignore[attr-defined]
    stored = opened.get_slice(name)  # type: ignore[attr-defined]
    shape = tuple(stored.get_shape())
    box = tuple((int(start), int(stop)) for start, stop in box)
    if len(box) != len(shape) or any(not 0 <= start <= stop <= size for (start, stop), size in zip(box, shape)):
        raise CheckpointError(
            f"box {[list(span) for span in box]} of {key!r} does not fit its stored shape {list(shape)} in {file}: the file holds "
            "another model's or another configuration's weights; build the model with the checkpoint's configuration"
        )
    if not shape:
        return opened.get_tensor(name)  # type: ignore[attr-defined]
    return stored[region(box)]
