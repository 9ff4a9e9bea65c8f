"""Sharded checkpoints: every rank writes its own pieces; any plan loads them; nothing damaged loads silently.

A checkpoint is a directory named like a Lightning checkpoint file (e.g. ``epoch=0-step=10.ckpt``);
``layout`` describes it and its atomic commit (a ``CURRENT`` pointer file switched with
``os.replace``, so overwriting ``last.ckpt`` never leaves it empty). The save it names holds::

    rank00000-of-00002.pt   this rank's pieces: model boxes and optimizer state (one writer per piece)
    common.pt               everything else Lightning saves (loops, callbacks, LR schedulers, hparams,
                            optimizer hyperparameters), written by rank 0
    metadata.json           the plan (recipe, parameters, world size, code hash), the full shapes, each
                            optimizer's param-group keys, the save's token and step, every file's
                            size and content hash (``integrity``), and which rank file holds which
                            pieces (``pieces``: ``index``; absent in earlier saves): written last, by rank 0

Integrity: every load reads each file once, checks its size and content hash against the metadata,
and the save token each rank file and ``common.pt`` carries against the metadata's: a flipped bit,
a truncated file, or a file copied from another save is refused naming the file, what is wrong and
what to do (``CheckpointError``). The metadata must list every rank file its world size requires.

Paths (``target``): a save never deletes what it did not write. It refuses, before writing anything, a
path that is a file or a directory holding files this format did not write (a user's directory, or a
checkpoint someone put a file into); it replaces a checkpoint of its own, as Lightning replaces a file.
One job saves to a path at a time (rank 0 holds a lock in it); a second is refused by name. Each
checkpoint holds a ``README.txt`` for tools that expect a file (``torch.load`` and ``strategy="auto"``
raise IsADirectoryError on it): load it with the nnscaler strategy or ``lightning-nnscaler ckpt merge``.

Resharding: ``load`` assembles the single-device Lightning checkpoint (full ``state_dict``, each
optimizer's ``state_dict`` over the whole module) from all the rank files, whatever plan wrote
them (``assemble``); the strategy then cuts it into the new plan's pieces. ``merge`` writes that
assembly as one plain file which loads with ``strategy="auto"``. Every load is
``torch.load(weights_only=True)``.

Per-slice reads (``read_pieces``, ``slices``): a rank reads only the pieces of its own plan (boxes or ZeRO
chunks, of the model and of each optimizer's state) from whichever saved pieces overlap them, under any
saving plan and world size, and the non-tensor part; no process assembles the checkpoint, and a rank file
holding none of them is not opened.

Streaming (``model_tensors``, ``export_safetensors``): the model weights alone, one full tensor at a
time from the memory-mapped rank files (their hashes checked through the mapping, not copied), so the
memory held is about the largest tensor; ``export_safetensors`` writes them as a Hugging Face
safetensors directory (``export``). ``merge`` to a ``.ckpt`` file still assembles everything (the
optimizer states too) in memory: ``torch.save`` pickles one dict.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any, Iterator

import torch

from lightning_nnscaler.checkpoint.assemble import assemble_model_state, full_optimizer_state, stream_model_state
from lightning_nnscaler.checkpoint.export import DEFAULT_MAX_SHARD_SIZE, check_output, write_safetensors
from lightning_nnscaler.checkpoint.integrity import CheckpointError, check_file, torch_load, torch_load_mapped, write_hashed
from lightning_nnscaler.checkpoint.layout import (
    COMMON, FORMAT, METADATA, POINTER, README, SAVE_RECORD, VERSION, commit, current_save, enclosing_checkpoint, foreign_entries,
    is_sharded_checkpoint, leftovers, merge_hint, partial_directory, rank_file_name, remove_leftovers, required_files, save_directory,
    write_readme,
)
from lightning_nnscaler.checkpoint.slices import PieceRead, read_pieces
from lightning_nnscaler.checkpoint.target import check_target, claim
from lightning_nnscaler.ir.box import PieceLocation

__all__ = [
    "COMMON", "FORMAT", "METADATA", "POINTER", "README", "SAVE_RECORD", "VERSION", "CheckpointError", "check_target", "claim", "commit",
    "current_save", "describe", "export_safetensors", "foreign_entries", "is_sharded_checkpoint", "leftovers", "load", "merge", "merge_hint", "model_tensors", "open_merged",
    "partial_directory", "rank_file_name", "rank_payload", "read_metadata", "remove_leftovers", "required_files", "save_directory",
    "write_atomically", "write_readme", "PieceRead", "read_pieces",
]


def write_atomically(payload: Any, path: Path) -> dict[str, Any]:
    """``torch.save`` to a temporary name, flushed to disk, renamed to ``path``; returns the file's ``{"size", "hash"}``."""
    return write_hashed(payload, path)


def rank_payload(
    model_pieces: list[tuple[PieceLocation, torch.Tensor]],
    optimizer_pieces: list[list[tuple[PieceLocation, dict[str, Any]]]],
    *,
    save: dict[str, Any],
) -> dict[str, Any]:
    """What one rank's file holds: its model pieces, per optimizer its pieces' states (tensors on the CPU), and ``save``:
    the save's record (``token``, ``rank``, ``world_size``, ``global_step``), checked on load."""
    return {
        "save": save,
        "model": [{**location.to_plain(), "value": _to_cpu(value)} for location, value in model_pieces],
        "optimizers": [
            [{**location.to_plain(), "state": {name: _to_cpu(value) for name, value in state.items()}} for location, state in pieces]
            for pieces in optimizer_pieces
        ],
    }


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The metadata of the save ``path`` holds, checked (format, hash, completeness); the other files are not read.

    Raises:
        CheckpointError: see ``layout.current_save``.
    """
    return current_save(path)[1]


def _read_file(directory: Path, name: str, metadata: dict[str, Any], what: str) -> Any:
    """The checked contents of one file of the save: size, content hash, then its save record.

    Raises:
        CheckpointError: missing, another size or hash (named as a file of another save when its record says so), unreadable.
    """
    file = directory / name
    token, step = metadata["save"]["token"], metadata["save"].get("global_step")
    try:
        check_file(file, metadata["files"][name], what)
    except CheckpointError:
        try:
            record = _save_record(torch_load(None, file), name)
        except CheckpointError:
            record = None
        if record and record.get("token") != token:
            raise CheckpointError(
                f"{file} belongs to save {record.get('token')!r} (step {record.get('global_step')}), not to this checkpoint's save "
                f"{token!r} (step {step}): it was copied from another checkpoint. Restore this save's file, or load the checkpoint it came from"
            ) from None
        raise
    payload = torch_load(None, file) if name == COMMON else torch_load_mapped(file)  # rank files: the assembly copies every tensor
    record = _save_record(payload, name)
    if not record or record.get("token") != token:
        raise CheckpointError(f"{file} carries save record {record!r}, not this checkpoint's save {token!r}: the file is of another save; load another checkpoint")
    if name != COMMON and (record.get("rank"), record.get("world_size")) != _rank_of(name):
        raise CheckpointError(f"{file} was written by rank {record.get('rank')} of {record.get('world_size')}, not as its name says: the checkpoint is damaged")
    return payload


def _rank_of(name: str) -> tuple[int, int]:
    rank, world_size = name.removeprefix("rank").removesuffix(".pt").split("-of-")
    return int(rank), int(world_size)


def _save_record(payload: Any, name: str) -> dict[str, Any] | None:
    if not isinstance(payload, dict):
        return None
    record = payload.get(SAVE_RECORD if name == COMMON else "save")
    return record if isinstance(record, dict) else None


def load(path: str | os.PathLike) -> dict[str, Any]:
    """The single-device Lightning checkpoint assembled from a sharded checkpoint directory, every file checked
    (a plain Lightning checkpoint file is read as it is).

    The result is what ``strategy="auto"`` would have saved: a full ``state_dict`` and each
    optimizer's ``state_dict`` over the whole module, with the saved param groups.

    Raises:
        CheckpointError: see ``layout.current_save`` and ``_read_file``; a piece of the wrong shape or a tensor not covered.
    """
    path = Path(path)
    if path.is_file():
        return _load_plain(path)
    directory, metadata = current_save(path)
    checkpoint = _read_file(directory, COMMON, metadata, "common part (written by rank 0)")
    checkpoint.pop(SAVE_RECORD)
    world_size = metadata["world_size"]
    rank_files = [
        (directory / name, _read_file(directory, name, metadata, f"rank {rank}'s pieces"))
        for rank, name in enumerate(rank_file_name(rank, world_size) for rank in range(world_size))
    ]
    shapes = {key: tuple(shape) for key, shape in metadata["shapes"].items()}
    checkpoint["state_dict"] = assemble_model_state(metadata, rank_files, path)
    if "optimizer_states" in checkpoint:
        checkpoint["optimizer_states"] = [
            full_optimizer_state(saved, metadata["param_group_keys"][index], [(file, payload["optimizers"][index]) for file, payload in rank_files], shapes)
            for index, saved in enumerate(checkpoint["optimizer_states"])
        ]
    return checkpoint


def _checked_rank_files(path: str | os.PathLike) -> tuple[dict[str, Any], list[tuple[Path, dict[str, Any]]]]:
    """The metadata and every rank file, each checked (size, content hash, save record) and memory-mapped."""
    if Path(path).is_file():
        _load_plain(Path(path))
        raise CheckpointError(f"{path} is a plain Lightning checkpoint (one file), not a sharded directory: read its state_dict with torch.load")
    directory, metadata = current_save(path)
    world_size = metadata["world_size"]
    return metadata, [
        (directory / name, _read_file(directory, name, metadata, f"rank {rank}'s pieces"))
        for rank, name in enumerate(rank_file_name(rank, world_size) for rank in range(world_size))
    ]


def model_tensors(path: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """The single-device ``state_dict`` of a sharded checkpoint as ``(key, tensor)``, one tensor assembled at a time
    (``assemble.stream_model_state``): every rank file is checked first; a tensor may be a view of a mapped file.

    Raises:
        CheckpointError: see ``load``.
    """
    metadata, rank_files = _checked_rank_files(path)
    yield from stream_model_state(metadata, rank_files, Path(path))


def export_safetensors(
    path: str | os.PathLike, output: str | os.PathLike, *, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, strip_prefix: str | None = None
) -> list[str]:
    """Write the model weights of the sharded checkpoint at ``path`` as a Hugging Face safetensors directory ``output``
    (``model.safetensors``, or shards of at most ``max_shard_size`` and ``model.safetensors.index.json``), streamed
    tensor by tensor; keys lose ``strip_prefix`` (e.g. ``"model."``). Returns the files written.

    Raises:
        CheckpointError: ``output`` exists and is not an empty directory (checked before reading), ``path`` is damaged,
            or see ``export.write_safetensors``.
    """
    check_output(Path(output))
    metadata, rank_files = _checked_rank_files(path)
    return write_safetensors(
        metadata, stream_model_state(metadata, rank_files, Path(path)), output, max_shard_size=max_shard_size, strip_prefix=strip_prefix
    )


def describe(path: str | os.PathLike, *, verify: bool = False) -> dict[str, Any]:
    """What ``ckpt info`` prints: a sharded checkpoint's plan, save, files and leftovers (with ``verify``, after
    reading and checking every file and assembling the pieces), or a plain Lightning checkpoint's summary.

    Raises:
        CheckpointError: a damaged sharded checkpoint, or a file that is no Lightning checkpoint.
    """
    path = Path(path)
    if path.is_file():
        return _describe_plain(path)
    metadata = read_metadata(path)
    shown = {key: metadata.get(key) for key in ("recipe", "recipe_params", "world_size", "plan_hash", "files", "save")}
    shown["kind"] = f"lightning-nnscaler sharded checkpoint v{VERSION}"
    shown["leftovers"] = leftovers(path)
    if verify:
        load(path)
        shown["verified"] = "every file's size, content hash and save token match the metadata; the pieces assemble"
    return shown


def _load_plain(path: Path) -> dict[str, Any]:
    """A plain (single-file) Lightning checkpoint.

    Raises:
        CheckpointError: the file lies inside a sharded checkpoint (the hint names the directory and the merge
            command), is not a torch file, or not a Lightning checkpoint.
    """
    inside = enclosing_checkpoint(path)
    if inside is not None:
        raise CheckpointError(f"{path} is one file of a sharded checkpoint, not a checkpoint: pass its directory instead. {merge_hint(inside)}")
    payload = torch_load(None, path)
    if not isinstance(payload, dict) or not ({"state_dict", "pytorch-lightning_version"} & set(payload)):
        raise CheckpointError(f"{path} is a torch file but not a Lightning checkpoint (no state_dict): pass a checkpoint directory or file")
    return payload


def _describe_plain(path: Path) -> dict[str, Any]:
    """A plain (single-file) Lightning checkpoint's summary (see ``_load_plain``)."""
    payload = _load_plain(path)
    return {
        "kind": "plain Lightning checkpoint (one file: loads with any strategy; nothing to merge)",
        "global_step": payload.get("global_step"), "epoch": payload.get("epoch"),
        "lightning_version": payload.get("pytorch-lightning_version"), "tensors": len(payload.get("state_dict", {})),
    }


def merge(path: str | os.PathLike, output: str | os.PathLike) -> None:
    """Write the sharded checkpoint at ``path`` as one plain Lightning checkpoint file ``output`` (atomically).

    Raises:
        CheckpointError: ``path`` is damaged, or a file (a plain Lightning checkpoint needs no merge; another file is refused).
    """
    if Path(path).is_file():
        _load_plain(Path(path))
        raise CheckpointError(f"{path} is already a plain Lightning checkpoint (one file), not a sharded directory: use it as is; nothing to merge")
    checkpoint = load(path)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    write_hashed(checkpoint, output)


def open_merged(path: str | os.PathLike) -> io.BytesIO:
    """The sharded checkpoint at ``path`` as an in-memory plain checkpoint file, for APIs that read
    one, e.g. ``MyModule.load_from_checkpoint(open_merged(path))``."""
    buffer = io.BytesIO()
    torch.save(load(path), buffer)
    buffer.seek(0)
    return buffer


def _to_cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value
