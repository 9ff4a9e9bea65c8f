"""A state_dict streamed out as a Hugging Face safetensors directory, one tensor in memory at a time.

The layout ``transformers``' ``from_pretrained`` reads (``modeling_utils``: ``SAFE_WEIGHTS_NAME``,
``SAFE_WEIGHTS_INDEX_NAME``)::

    model.safetensors                       when everything fits in one shard; otherwise
    model-00001-of-00003.safetensors ...    shards of at most ``max_shard_size`` bytes (a larger tensor alone in one)
    model.safetensors.index.json            {"metadata": {"total_size": bytes}, "weight_map": {key: shard file}}

Why the format is written here rather than with ``safetensors.torch.save_file``: ``save_file`` takes
a dict of a whole shard's tensors (5 GB by default), while a safetensors file is just an 8-byte
little-endian header length, a JSON header (each tensor's dtype, shape and byte offsets; padded with
spaces to 8 bytes) and the tensors' raw bytes back to back (https://github.com/huggingface/safetensors#format).
The checkpoint's metadata gives every shape and dtype before any tensor is read, so the headers, the
shards and the index are planned first; then each tensor is assembled, its bytes written, and dropped.

The directory is written under a hidden temporary name beside ``output`` and renamed into place: a
reader never sees a half-written export. An existing ``output`` is refused unless it is an empty
directory (this tool never deletes what it did not write).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from lightning_nnscaler.checkpoint.integrity import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers' save_pretrained default

# torch dtype name (as the checkpoint metadata records it) -> safetensors dtype code.
_DTYPE_CODES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8",
    "bool": "BOOL",
}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes of a size such as ``"5GB"`` (10**9, as transformers reads it), ``"500MiB"`` or ``1000``.

    Raises:
        ValueError: not a positive size with a known unit.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).upper() not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a size: write e.g. 5GB, 500MB, 2GiB or a number of bytes")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


@dataclass(frozen=True)
class _Entry:
    key: str  # the name written (prefix stripped)
    dtype: str  # the safetensors code
    shape: tuple[int, ...]
    size: int  # bytes


def plan_shards(entries: list[_Entry], max_shard_size: int) -> list[list[_Entry]]:
    """The entries in shards, in order, as transformers splits them: a shard takes tensors until the next would pass
    ``max_shard_size``; a tensor larger than that fills a shard alone."""
    shards: list[list[_Entry]] = [[]]
    used = 0
    for entry in entries:
        if shards[-1] and used + entry.size > max_shard_size:
            shards.append([])
            used = 0
        shards[-1].append(entry)
        used += entry.size
    return shards


def _header(shard: list[_Entry]) -> bytes:
    """The 8-byte header length and the JSON header of a safetensors file holding ``shard`` in order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for entry in shard:
        header[entry.key] = {"dtype": entry.dtype, "shape": list(entry.shape), "data_offsets": [offset, offset + entry.size]}
        offset += entry.size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(text)) + text


def _entries(metadata: dict[str, Any], strip_prefix: str | None) -> list[_Entry]:
    """The written name, dtype, shape and bytes of each state_dict key, from the metadata alone.

    Raises:
        CheckpointError: a key without ``strip_prefix``, or a dtype safetensors cannot hold.
    """
    keys = metadata["state_keys"]
    if strip_prefix:
        outside = [key for key in keys if not key.startswith(strip_prefix)]
        if outside:
            raise CheckpointError(
                f"--strip-prefix {strip_prefix!r}: {len(outside)} key(s) do not start with it (e.g. {', '.join(outside[:5])}): "
                "pass the prefix every key shares (e.g. 'model.' for a LightningModule holding self.model), or none"
            )
    entries = []
    for key in keys:
        dtype = metadata["dtypes"][key]
        if dtype not in _DTYPE_CODES:
            raise CheckpointError(f"{key!r} is {dtype}, which safetensors cannot hold: convert it, or merge to a .ckpt file instead")
        shape = tuple(metadata["shapes"][key])
        numel = 1
        for size in shape:
            numel *= size
        element_size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        entries.append(_Entry(key.removeprefix(strip_prefix) if strip_prefix else key, _DTYPE_CODES[dtype], shape, numel * element_size))
    return entries


def check_output(output: Path) -> None:
    """Refuse an ``output`` that exists and is not an empty directory, before anything is read or written.

    Raises:
        CheckpointError: naming ``output`` and what is in it.
    """
    if output.is_dir():
        found = sorted(child.name for child in output.iterdir())
        if found:
            raise CheckpointError(
                f"{output} exists and is not empty (it holds {', '.join(found[:5])}{', ...' if len(found) > 5 else ''}): "
                "export into a new or empty directory; nothing in it is replaced"
            )
    elif output.exists():
        raise CheckpointError(f"{output} exists and is a file: export into a new or empty directory")


def write_safetensors(
    metadata: dict[str, Any], tensors: Iterable[tuple[str, torch.Tensor]], output: str | os.PathLike, *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, strip_prefix: str | None = None,
) -> list[str]:
    """Write ``tensors`` (``(state_dict key, tensor)`` in the metadata's key order, e.g. ``assemble.stream_model_state``)
    as a Hugging Face safetensors directory ``output``; returns the files written.

    Each tensor's bytes go straight to its shard (a contiguous tensor is not copied) and nothing is kept.

    Raises:
        CheckpointError: ``output`` exists and is not an empty directory, a key lacks ``strip_prefix``, a dtype
            safetensors cannot hold, or a tensor disagrees with the metadata; nothing is left at ``output``.
    """
    output = Path(output)
    check_output(output)
    entries = _entries(metadata, strip_prefix)
    shards = plan_shards(entries, parse_size(max_shard_size))
    names = [SINGLE_FILE] if len(shards) == 1 else [f"model-{index:05d}-of-{len(shards):05d}.safetensors" for index in range(1, len(shards) + 1)]
    output.parent.mkdir(parents=True, exist_ok=True)
    temporary = output.with_name(f".{output.name}.tmp-{uuid.uuid4().hex[:12]}")
    temporary.mkdir()
    try:
        _write_shards(temporary, names, shards, iter(tensors))
        if len(shards) > 1:
            index = {
                "metadata": {"total_size": sum(entry.size for entry in entries)},
                "weight_map": {entry.key: name for name, shard in zip(names, shards) for entry in shard},
            }
            (temporary / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        check_output(output)  # still new or empty
        if output.is_dir():
            output.rmdir()  # empty: replaced by the export (rename does not replace a non-empty directory)
        os.rename(temporary, output)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)  # ours alone: a hidden name this call made
        raise
    return [*names, *([INDEX_FILE] if len(shards) > 1 else [])]


def _write_shards(directory: Path, names: list[str], shards: list[list[_Entry]], tensors: Any) -> None:
    """Write each shard's header and then its tensors' bytes, taking the tensors one at a time from ``tensors``."""
    for name, shard in zip(names, shards):
        with open(directory / name, "wb") as stream:
            stream.write(_header(shard))
            for entry in shard:
                key, tensor = next(tensors)
                if tuple(tensor.shape) != entry.shape or _DTYPE_CODES.get(str(tensor.dtype).removeprefix("torch.")) != entry.dtype:
                    raise CheckpointError(f"{key!r} is {tensor.dtype} {list(tensor.shape)}, not {entry.dtype} {list(entry.shape)} as the metadata says: the checkpoint is damaged")
                _write_tensor(stream, tensor)
                del tensor
            stream.flush()
            os.fsync(stream.fileno())


def _write_tensor(stream: Any, tensor: torch.Tensor) -> None:
    """A tensor's raw bytes (little-endian, row-major, as safetensors stores them); a copy only of a non-contiguous tensor."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel():
        stream.write(memoryview(flat.view(torch.uint8).numpy()))
