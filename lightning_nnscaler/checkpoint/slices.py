"""Read one rank's pieces of a sharded checkpoint, whatever plan and world size saved it, without assembling it.

``read_pieces`` returns, for each location a rank wants (a box of a tensor, or a ZeRO chunk of a box), its
values put together from whichever saved pieces (boxes or chunks of the saving plan) overlap it
(``overlap``), likewise each optimizer's state of the locations it updates, and the checkpoint's
non-tensor part. No process holds more than its own pieces: a rank file is memory-mapped
(``torch.load(mmap=True, weights_only=True)``) and only the overlapping slices are copied; a file holding
nothing a wanted location overlaps is not opened. Which file holds what comes from the metadata's index
(``index``); a checkpoint saved before the index existed has each rank file's pickle read instead (its
tensors stay unread in the mapping), so every file is opened, but still only the overlapping bytes copied.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch

from lightning_nnscaler.checkpoint.assemble import _is_elementwise
from lightning_nnscaler.checkpoint.index import FileIndex, describe, file_index, fits, indexed_files
from lightning_nnscaler.checkpoint.integrity import CheckpointError, check_file, torch_load, torch_load_mapped
from lightning_nnscaler.checkpoint.layout import COMMON, METADATA, SAVE_RECORD, current_save, rank_file_name
from lightning_nnscaler.checkpoint.overlap import gather, overlaps, scalar_state
from lightning_nnscaler.ir.box import PieceLocation, full_box

__all__ = ["PieceRead", "read_pieces"]

_Held = tuple[str, PieceLocation]  # a saved piece: the rank file holding it, its location


@dataclass
class PieceRead:
    """What ``read_pieces`` returns."""

    model: dict[PieceLocation, torch.Tensor]
    """Each wanted model location's values (shaped like the location: a box's shape, or ``(size,)`` for a chunk)."""
    optimizers: list[dict[PieceLocation, dict[str, Any]]]
    """Per optimizer, each wanted location's state (e.g. Adam's ``exp_avg``/``exp_avg_sq`` shaped like the location,
    ``step`` as saved); a location whose parameter has no state in the checkpoint (never stepped) is absent."""
    common: dict[str, Any]
    """The checkpoint without its tensors: what ``checkpoint.load`` returns less ``state_dict``, each of its
    ``optimizer_states`` holding an empty ``state`` and the single-device ``param_groups`` (``params`` are indices
    into the keys of ``metadata["param_group_keys"]``), ready for Lightning's loops, callbacks and schedulers."""
    metadata: dict[str, Any]
    """The checkpoint's metadata (plan, world size, shapes, dtypes, tied keys, param group keys, file records)."""
    bytes_read: int
    """The bytes of the saved slices copied (each overlap's elements times their size): about the rank's share."""
    files_read: list[str]
    """The rank files whose pieces were read (checked and mapped), sorted."""
    bytes_hashed: int
    """The bytes of the rank files hashed (with ``verify``: each file read in whole, not kept in memory)."""


def read_pieces(
    path: str | os.PathLike,
    model: Iterable[PieceLocation],
    optimizers: Optional[Sequence[Iterable[PieceLocation]]] = None,
    *,
    verify: bool = True,
    shapes: Optional[Mapping[str, Sequence[int]]] = None,
) -> PieceRead:
    """Read the wanted pieces of the sharded checkpoint at ``path`` (any plan, any world size saved it).

    Args:
        model: The model locations this rank holds: boxes of tensors, or ZeRO chunks of boxes (``location.chunk``).
        optimizers: Per optimizer (in the checkpoint's order), the locations whose state this rank's optimizer updates;
            None reads no optimizer state.
        verify: Check the content hash of every rank file read (each is read in whole by the hash, through the page
            cache, not into memory). Without it a rank file is checked only for its size, its save record (token, rank,
            world size) and that it holds the pieces the index says: a flipped bit in its tensor data goes unnoticed.
            ``metadata.json`` (through ``CURRENT``) and ``common.pt`` are always hash-checked; a file no wanted
            location overlaps is never opened, so not checked.
        shapes: The full shape of each tensor in the model reading it: a wanted key whose checkpoint shape differs
            is refused (else a box inside both shapes would be read silently from another tensor).

    Raises:
        CheckpointError: a wanted key the checkpoint (or the optimizer) lacks, a box outside its tensor, a shape
            that differs from ``shapes``, a wanted piece the saved pieces do not cover in full, optimizer state
            asked of a checkpoint saved without it, a damaged or mismatched file; each naming the key, the
            box and the file.
    """
    directory, metadata = current_save(path)
    wanted_model = list(model)
    wanted_optimizers = [list(pieces) for pieces in optimizers or []]
    _check_wanted(metadata, directory, wanted_model, wanted_optimizers, shapes)
    reader = _Reader(directory, metadata, verify)
    common = _read_common(directory, metadata)
    values = {location: reader.model_piece(location) for location in wanted_model}
    states: list[dict[PieceLocation, dict[str, Any]]] = []
    for index, pieces in enumerate(wanted_optimizers):
        read = {location: reader.optimizer_piece(index, location) for location in pieces}
        states.append({location: state for location, state in read.items() if state is not None})
    return PieceRead(values, states, common, metadata, reader.bytes_read, sorted(reader.used), reader.bytes_hashed)


def _check_wanted(
    metadata: dict[str, Any], directory: Path, model: list[PieceLocation], optimizers: list[list[PieceLocation]],
    shapes: Optional[Mapping[str, Sequence[int]]],
) -> None:
    """Every wanted key is in the checkpoint (and, for optimizer state, in that optimizer), its box inside its shape.

    Raises:
        CheckpointError: naming the key, the box, the checkpoint's shape and what to do.
    """
    group_keys = metadata.get("param_group_keys") or []
    if len(optimizers) > len(group_keys):
        raise CheckpointError(
            f"{directory.parent}: optimizer state of {len(optimizers)} optimizer(s) is wanted, but the checkpoint holds "
            f"{len(group_keys)} (saved without optimizer states, e.g. save_weights_only, or by a module with fewer "
            "optimizers): read no optimizer state from it"
        )
    for location in model:
        _check_location(metadata, directory.parent, location, shapes)
    tied = _tied(metadata)
    for index, pieces in enumerate(optimizers):
        updated = {key for keys in group_keys[index] for key in keys}
        for location in pieces:
            _check_location(metadata, directory.parent, location, shapes)
            if not {location.state_key, *tied.get(location.state_key, ())} & updated:
                raise CheckpointError(
                    f"{location.state_key!r} is no parameter of optimizer {index} in the checkpoint {directory.parent} (its param "
                    f"groups: {group_keys[index]}): read its state from the optimizer that updates it"
                )


def _check_location(metadata: dict[str, Any], path: Path, location: PieceLocation, shapes: Optional[Mapping[str, Sequence[int]]]) -> None:
    """One wanted location: its key in the checkpoint, of the model's shape, its box inside it.

    Raises:
        CheckpointError: naming the key, the box, both shapes and what to do.
    """
    key, known = location.state_key, metadata["shapes"]
    if key not in known:
        raise CheckpointError(
            f"{key!r} is not in the checkpoint {path} ({len(known)} tensors, e.g. {sorted(known)[:3]}): the model has a tensor the "
            "checkpoint lacks; load a checkpoint of this model (or rename the key)"
        )
    if shapes is not None and key in shapes and tuple(shapes[key]) != tuple(known[key]):
        raise CheckpointError(
            f"{key!r} is {list(known[key])} in the checkpoint {path} but {list(shapes[key])} in the model: build the model with "
            "the checkpoint's configuration, or load a checkpoint of this model"
        )
    if not fits(location, known[key]):
        raise CheckpointError(
            f"the wanted {describe(location)} of {key!r} does not fit its shape {list(known[key])} in the checkpoint {path}: "
            "the plan is of another model; build the model with the checkpoint's configuration"
        )


def _tied(metadata: dict[str, Any]) -> dict[str, list[str]]:
    """Each tied key -> the other keys of its group."""
    return {key: [other for other in group if other != key] for group in metadata.get("tied", []) for key in group}


def _read_common(directory: Path, metadata: dict[str, Any]) -> dict[str, Any]:
    """``common.pt``, hash-checked, without its save record; each optimizer state an empty ``state`` and its param groups.

    Raises:
        CheckpointError: missing, another size or hash, unreadable, or of another save.
    """
    file, token = directory / COMMON, metadata["save"]["token"]
    check_file(file, metadata["files"][COMMON], "common part (written by rank 0)")
    common = torch_load(None, file)
    record = common.pop(SAVE_RECORD, None) if isinstance(common, dict) else None
    if not isinstance(record, dict) or record.get("token") != token:
        raise CheckpointError(
            f"{file} carries save record {record!r}, not this checkpoint's save {token!r}: it is of another save; load another checkpoint"
        )
    if "optimizer_states" in common:
        common["optimizer_states"] = [{"state": {}, "param_groups": state["param_groups"]} for state in common["optimizer_states"]]
    return common


class _Reader:
    """The rank files of one save, opened (checked, memory-mapped) on first use; the bytes copied and hashed."""

    def __init__(self, directory: Path, metadata: dict[str, Any], verify: bool) -> None:
        self.directory, self.metadata, self.verify = directory, metadata, verify
        self.shapes = metadata["shapes"]
        self.tied = _tied(metadata)
        self.names = [rank_file_name(rank, metadata["world_size"]) for rank in range(metadata["world_size"])]
        self.payloads: dict[str, dict[str, Any]] = {}
        self.used: set[str] = set()
        self.bytes_read = self.bytes_hashed = 0
        index = self.index = indexed_files(metadata, directory / METADATA)
        if index is None:  # saved before the index: each file's pickle says what it holds
            index = {name: self._load(name) for name in self.names}
        self.model_pieces: dict[str, list[_Held]] = defaultdict(list)
        self.optimizer_pieces: list[dict[str, list[_Held]]] = []
        for name, held in index.items():
            for location in held.model:
                self.model_pieces[location.state_key].append((name, location))
            for number, pieces in enumerate(held.optimizers):
                while len(self.optimizer_pieces) <= number:
                    self.optimizer_pieces.append(defaultdict(list))
                for location in pieces:
                    self.optimizer_pieces[number][location.state_key].append((name, location))

    def model_piece(self, location: PieceLocation) -> torch.Tensor:
        """The values of one wanted model location, from the saved pieces it overlaps."""
        entries = self._overlapping(location, self.model_pieces)
        sources = [(saved, self._model_value(name, saved), name) for name, saved in entries]
        dtype = getattr(torch, self.metadata["dtypes"][location.state_key])
        values, copied = gather(location, sources, dtype, f"{self.directory}: {location.state_key!r}")
        self.bytes_read += copied
        return values

    def optimizer_piece(self, index: int, location: PieceLocation) -> Optional[dict[str, Any]]:
        """The state optimizer ``index`` holds for one wanted location: per-element entries put together from the
        overlapping pieces, the others (a scalar ``step``) copied from the first; None when its parameter has none."""
        by_key = self.optimizer_pieces[index] if index < len(self.optimizer_pieces) else {}
        if not by_key.get(self._key(location.state_key, by_key)):
            return None
        what = f"{self.directory}: the state of optimizer {index} for {location.state_key!r}"
        entries = self._overlapping(location, by_key)
        if not entries:
            raise CheckpointError(
                f"{what}: no saved piece overlaps the wanted {describe(location)}: the checkpoint lacks part of this tensor (the "
                "saving plan did not hold it, or a rank file lost it); load another checkpoint"
            )
        states = [(name, saved, self._optimizer_state(name, index, saved)) for name, saved in entries]
        first_name, first_saved, first_state = states[0]
        for name, saved, state in states[1:]:
            if set(state) != set(first_state):
                raise CheckpointError(
                    f"{what}: {name} holds the entries {sorted(state)} for {describe(saved)}, {first_name} {sorted(first_state)} for "
                    f"{describe(first_saved)}: the checkpoint is damaged; load another"
                )
        result = {}
        for entry, sample in first_state.items():
            if not _is_elementwise(sample, first_saved):
                result[entry] = self._scalar(sample, first_saved, location, f"{what}, {entry!r} in {first_name}")
                continue
            sources = [(saved, _state_value(name, saved, state, entry, what), name) for name, saved, state in states]
            result[entry], copied = gather(location, sources, sample.dtype, f"{what}, {entry!r}")
            self.bytes_read += copied
        return result

    def _scalar(self, value: Any, saved: PieceLocation, wanted: PieceLocation, what: str) -> Any:
        """A state entry that is not per element: a scalar (Adam's ``step``) or non-tensor, copied; a tensor of
        another shape only when both pieces are the whole tensor (it cannot be cut).

        Raises:
            CheckpointError: a tensor neither per element nor a scalar, wanted in another piece than the whole.
        """
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            whole = full_box(self.shapes[saved.state_key])
            if not (saved.box == wanted.box == whole and saved.chunk is None and wanted.chunk is None):
                raise CheckpointError(
                    f"{what} is shaped {list(value.shape)}, neither per element of {describe(saved)} nor a scalar: it cannot be cut "
                    f"into {describe(wanted)}; read it under a plan that holds the whole tensor"
                )
        if isinstance(value, torch.Tensor):
            self.bytes_read += value.numel() * value.element_size()
        return scalar_state(value)

    def _key(self, key: str, by_key: Mapping[str, list[Any]]) -> str:
        """``key``, or the key of its tied group the pieces are saved under."""
        return key if by_key.get(key) else next((other for other in self.tied.get(key, ()) if by_key.get(other)), key)

    def _overlapping(self, location: PieceLocation, by_key: Mapping[str, list[_Held]]) -> list[_Held]:
        """The saved pieces (of the key or its tied source) that overlap ``location``, their files opened and checked."""
        key = self._key(location.state_key, by_key)
        entries = [(name, saved) for name, saved in by_key.get(key, ()) if overlaps(location, saved)]
        for name, _ in entries:
            self._use(name)
        return entries

    def _model_value(self, name: str, saved: PieceLocation) -> Callable[[], torch.Tensor]:
        piece = self.payloads[name]["model"][saved]
        what = f"{self.directory / name}: the model piece {describe(saved)} of {saved.state_key!r}"
        return lambda: _checked(piece.get("value"), saved, what)

    def _optimizer_state(self, name: str, index: int, saved: PieceLocation) -> dict[str, Any]:
        state = self.payloads[name]["optimizers"][index][saved].get("state")
        if not isinstance(state, dict):
            raise CheckpointError(
                f"{self.directory / name}: the state of optimizer {index} for {describe(saved)} of {saved.state_key!r} is "
                f"{type(state).__name__}, not a dict: the file is damaged; load another checkpoint"
            )
        return state

    def _use(self, name: str) -> None:
        """Check (its hash, with ``verify``) and open the rank file ``name``, once."""
        if name in self.used:
            return
        if self.verify:
            check_file(self.directory / name, self.metadata["files"][name], f"rank {self.names.index(name)}'s pieces")
            self.bytes_hashed += int(self.metadata["files"][name]["size"])
        if name not in self.payloads:
            self._load(name)
        self.used.add(name)

    def _load(self, name: str) -> FileIndex:
        """Map the rank file ``name``: its size and save record checked, with the index its pieces compared to it.

        Raises:
            CheckpointError: missing, another size, unreadable, of another save or rank, or not the pieces the index lists.
        """
        file, record, rank = self.directory / name, self.metadata["files"][name], self.names.index(name)
        try:
            size = file.stat().st_size
        except OSError as error:
            raise CheckpointError(
                f"{file} cannot be read ({type(error).__name__}): the checkpoint lacks rank {rank}'s pieces; restore the file or "
                "load another checkpoint"
            ) from None
        if size != record["size"]:
            raise CheckpointError(
                f"{file} is {size} bytes; the metadata says {record['size']} bytes: the file was truncated or replaced after the "
                "save. Restore it from a copy of this checkpoint, or load another checkpoint"
            )
        payload = torch_load_mapped(file)
        _check_record(payload, file, self.metadata["save"]["token"], rank, len(self.names))
        held = file_index(payload, file, self.shapes)
        if self.index is not None:
            _compare(held, self.index[name], file)
        self.payloads[name] = {
            "model": dict(zip(held.model, payload["model"])),
            "optimizers": [dict(zip(locations, pieces)) for locations, pieces in zip(held.optimizers, payload["optimizers"])],
        }
        return held


def _checked(value: Any, saved: PieceLocation, what: str) -> torch.Tensor:
    """A saved piece's tensor, checked to have its location's shape.

    Raises:
        CheckpointError: not a tensor, or of another shape.
    """
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != saved.shape:
        found = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise CheckpointError(f"{what} is {found}, not {list(saved.shape)}: the file is damaged; load another checkpoint")
    return value


def _state_value(name: str, saved: PieceLocation, state: dict[str, Any], entry: str, what: str) -> Callable[[], torch.Tensor]:
    return lambda: _checked(state[entry], saved, f"{what}, {entry!r} of {describe(saved)} in {name}")


def _check_record(payload: Any, file: Path, token: str, rank: int, world_size: int) -> None:
    """The rank file's save record: this save's token, and the rank and world size its name says.

    Raises:
        CheckpointError: another save's file, or another rank's.
    """
    record = payload.get("save") if isinstance(payload, dict) else None
    if not isinstance(record, dict) or record.get("token") != token:
        raise CheckpointError(
            f"{file} carries save record {record!r}, not this checkpoint's save {token!r}: the file is of another save; restore "
            "this save's file or load another checkpoint"
        )
    if (record.get("rank"), record.get("world_size")) != (rank, world_size):
        raise CheckpointError(
            f"{file} was written by rank {record.get('rank')} of {record.get('world_size')}, not as its name says: the checkpoint "
            "is damaged; load another"
        )


def _compare(held: FileIndex, indexed: FileIndex, file: Path) -> None:
    """The pieces a rank file holds are those the metadata's index lists for it.

    Raises:
        CheckpointError: naming the file and a piece in one list but not the other.
    """
    pairs = [("model", held.model, indexed.model)]
    pairs += [(f"optimizer {index}", found, listed) for index, (found, listed) in enumerate(zip(held.optimizers, indexed.optimizers))]
    if len(held.optimizers) != len(indexed.optimizers):
        pairs.append(("optimizer", [], [PieceLocation("(the state of other optimizers)", ())]))
    for what, found, listed in pairs:
        odd = set(found) ^ set(listed)  # a piece listed twice is still one piece
        if odd:
            example = next(iter(odd))
            shown = f"{describe(example)} of {example.state_key!r}"
            raise CheckpointError(
                f"{file} holds {len(found)} {what} piece(s), the metadata's index lists {len(listed)} for it, not the same "
                f"(e.g. {shown}): the file or the metadata is of another save; load another checkpoint"
            )
