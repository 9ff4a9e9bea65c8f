"""Pretrained weights read per slice: each rank reads only the boxes of the tensors it holds.

A source is a ``.safetensors`` file or a Hugging Face style directory: ``model.safetensors``; or
shards listed by ``model.safetensors.index.json``'s ``weight_map`` (any one ``*.safetensors.index.json``
is read the same way); or, without either, every ``*.safetensors`` file in it (a key in two of them is
refused). A box is copied out of the file mapped into memory: only the box's bytes are copied, so a rank
holding a quarter of a tensor (of its rows or of its columns) reads a quarter of its bytes.
``PretrainedWeights`` checks a module's keys and shapes against a source once, then reads it box by box
(``NnScalerStrategy(pretrained=...)``: each rank its own pieces).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable, Mapping, NamedTuple, Optional

import torch

from lightning_nnscaler.checkpoint.export import INDEX_FILE, SINGLE_FILE
from lightning_nnscaler.checkpoint.integrity import CheckpointError
from lightning_nnscaler.ir.box import Box, PieceLocation, full_box, region


def safe_open(path: str, **options: str):  # noqa: ANN201 - safetensors' own handle
    """``safetensors.safe_open``, imported when a file is first read (``import lightning_nnscaler`` stays light)."""
    from safetensors import safe_open as open_safetensors

    return open_safetensors(path, **options)


__all__ = ["PretrainedWeights", "SliceRead", "read_slices", "safetensors_files"]


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
    return _read_wanted(source, safetensors_files(source), wanted, dtype, key_map)


def _read_wanted(
    source: str | os.PathLike, files: dict[str, Path], wanted: Mapping[str, Optional[Box]], dtype: Optional[torch.dtype],
    key_map: Optional[Callable[[str], str]],
) -> SliceRead:
    """`read_slices` with ``source``'s file of each stored name known (``safetensors_files``)."""
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


class PretrainedWeights:
    """A module's pretrained weights in safetensors, read box by box: every key and shape is checked once, up front,
    and the bytes read are counted.

    Args:
        source: a ``.safetensors`` file or a directory holding them (see the module docstring).
        shapes: the module's state_dict keys and shapes (``module.state_dict()``'s, on meta too).
        tied: keys of one tensor of the module (tied weights): any of them may be the one stored.

    Raises:
        CheckpointError: a key is not in ``source`` (under none of its tied names) or is stored with another shape;
            the message names the key, both shapes or what the source holds, and what to do.
    """

    def __init__(self, source: str | os.PathLike, shapes: Mapping[str, tuple[int, ...]], tied: Iterable[Iterable[str]] = ()) -> None:
        self.source = source
        self.files = safetensors_files(source)
        self.bytes_read = 0
        """Bytes of the slices read so far."""
        aliases = {key: list(group) for group in map(list, tied) for key in group}
        self.names: dict[str, str] = {}
        """Each state key -> the name its values are stored under."""
        for key, shape in shapes.items():
            stored = next((name for name in aliases.get(key, [key]) if name in self.files), None)
            if stored is None:
                raise CheckpointError(
                    f"{key!r} (shape {list(shape)}) is not in the pretrained weights {source} ({len(self.files)} tensors, e.g. "
                    f"{sorted(self.files)[:3]}): save the model's state_dict with safetensors under its state_dict keys, or build "
                    "the model these weights belong to"
                )
            self.names[key] = stored
        self._check_shapes(shapes)

    def _check_shapes(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        by_file: dict[Path, list[str]] = {}
        for key, name in self.names.items():
            by_file.setdefault(self.files[name], []).append(key)
        for file, keys in by_file.items():
            with safe_open(str(file), framework="pt", device="cpu") as opened:
                for key in keys:
                    stored = tuple(opened.get_slice(self.names[key]).get_shape())
                    if stored != tuple(shapes[key]):
                        raise CheckpointError(
                            f"{key!r} has shape {list(stored)} in the pretrained weights {file}, but the module's is "
                            f"{list(shapes[key])}: the file holds another configuration's weights; build the model with the "
                            "configuration they were saved from"
                        )

    @classmethod
    def of_module(cls, source: str | os.PathLike, module: torch.nn.Module) -> PretrainedWeights:
        """``module``'s weights in ``source``: its state_dict's keys and shapes (on meta too), its tied keys as one."""
        state = module.state_dict(keep_vars=True)
        groups: dict[int, list[str]] = {}
        for key, tensor in state.items():
            groups.setdefault(id(tensor), []).append(key)
        return cls(source, {key: tuple(tensor.shape) for key, tensor in state.items()}, [keys for keys in groups.values() if len(keys) > 1])

    def read_piece(self, location: PieceLocation, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The stored values of a piece: its box, or (ZeRO) its zero-padded flat chunk of the box, cast to ``dtype``."""
        box = self.read(location.state_key, location.box, dtype)  # contiguous: a piece may be sent as it is
        return box if location.chunk is None else replace(location, box=full_box(box.shape)).take(box)

    def load_into(self, module: torch.nn.Module) -> None:
        """Replace the values of ``module``'s (real) tensors with the stored ones, one tensor at a time."""
        with torch.no_grad():
            for key, tensor in module.state_dict(keep_vars=True).items():
                tensor.copy_(self.read(key, dtype=tensor.dtype))

    def read(self, key: str, box: Optional[Box] = None, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The stored values of state key ``key`` (its ``box`` only, when given), cast to ``dtype``."""
        read = _read_wanted(self.source, self.files, {key: box}, dtype, self.names.__getitem__)
        self.bytes_read += read.bytes_read
        return read.tensors[key]


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
    mapped = _mapped_view(file, name)
    if mapped is None:  # a dtype torch cannot view: safetensors copies the rows the box spans
        return stored[region(box)].contiguous()
    return mapped[region(box)].clone(memory_format=torch.contiguous_format)


_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


def _mapped_view(file: Path, name: str) -> Optional[torch.Tensor]:
    """The stored tensor ``name`` as a view of ``file`` mapped into memory (nothing is read until a box of it is
    copied: a box across rows reads only its own elements, where safetensors' slicing copies every row it spans);
    None for a dtype or an offset torch cannot view."""
    with open(file, "rb") as stream:
        header_size = int.from_bytes(stream.read(8), "little")
        entry = json.loads(stream.read(header_size))[name]
    dtype = _DTYPES.get(entry["dtype"])
    start, stop = entry["data_offsets"]
    offset = 8 + header_size + start
    if dtype is None or offset % dtype.itemsize or stop == start:
        return None
    storage = torch.UntypedStorage.from_file(str(file), shared=False, nbytes=offset + stop - start)
    return torch.empty(0, dtype=dtype).set_(storage, offset // dtype.itemsize, tuple(entry["shape"]))
