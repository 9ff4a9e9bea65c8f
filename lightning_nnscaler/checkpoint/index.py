"""Which rank file of a sharded checkpoint holds which pieces, without opening the files.

The metadata's ``pieces`` (written by rank 0 at the commit: ``strategy.checkpoint.save_sharded``) maps each
rank file's name to its model pieces and, per optimizer, the pieces whose state it holds; each piece is a
row ``[key, "start:stop,..."]`` (its box, one span per dim; ``""`` for a scalar), for a ZeRO chunk
followed by its ``index, size`` (``ir.box.PieceLocation``): compact, as the index holds a row per piece
and file. Checkpoints saved before this index existed lack it: ``file_index`` then reads the locations
from a rank file itself (its pickle only; the tensors stay unread in the memory map).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping, NamedTuple, Optional, Sequence

from lightning_nnscaler.checkpoint.integrity import CheckpointError
from lightning_nnscaler.checkpoint.layout import rank_file_name
from lightning_nnscaler.ir.box import PieceLocation

INDEX_KEY = "pieces"
"""The metadata key of the index."""


class FileIndex(NamedTuple):
    """The pieces one rank file holds."""

    model: list[PieceLocation]
    optimizers: list[list[PieceLocation]]
    """Per optimizer (in the order of the checkpoint's ``optimizer_states``), the pieces whose state the file holds."""


def piece_index(files: Mapping[str, tuple[Iterable[PieceLocation], Sequence[Iterable[PieceLocation]]]]) -> dict[str, Any]:
    """The metadata's ``pieces``: rank file name -> ``{"model": [...], "optimizers": [[...], ...]}`` of rows
    ``[key, "0:4,0:6"]`` or ``[key, "0:4,0:6", index, size]`` (``files``: name -> its model pieces and, per
    optimizer, its pieces)."""
    return {
        name: {
            "model": [_row(location) for location in model],
            "optimizers": [[_row(location) for location in pieces] for pieces in optimizers],
        }
        for name, (model, optimizers) in files.items()
    }


def _row(location: PieceLocation) -> list[Any]:
    return [location.state_key, ",".join(f"{start}:{stop}" for start, stop in location.box), *(location.chunk or ())]


def indexed_files(metadata: dict[str, Any], metadata_path: Path) -> Optional[dict[str, FileIndex]]:
    """The index of every rank file from the metadata, each piece checked against the metadata's shapes; None when
    the metadata has no index (a checkpoint saved before it existed).

    Raises:
        CheckpointError: the index is malformed, lacks a rank file, or names a piece outside its tensor.
    """
    index = metadata.get(INDEX_KEY)
    if index is None:
        return None
    names = [rank_file_name(rank, metadata["world_size"]) for rank in range(metadata["world_size"])]
    if not isinstance(index, dict) or sorted(index) != sorted(names):
        listed = sorted(index) if isinstance(index, dict) else type(index).__name__
        raise CheckpointError(
            f"{metadata_path}: its {INDEX_KEY!r} index lists {listed}, not the rank files {names}: the metadata is damaged; "
            "load another checkpoint"
        )
    shapes = metadata["shapes"]
    parsed = {}
    for name in names:
        entry, where = index[name], f"{metadata_path} ({INDEX_KEY} of {name})"
        try:
            model = [checked_location(_plain(row), shapes, where) for row in entry["model"]]
            optimizers = [[checked_location(_plain(row), shapes, where) for row in pieces] for pieces in entry["optimizers"]]
        except (KeyError, TypeError, ValueError) as error:
            raise CheckpointError(
                f"{metadata_path}: the {INDEX_KEY!r} entry of {name} is malformed ({error!r}): the metadata is damaged; "
                "load another checkpoint"
            ) from None
        parsed[name] = FileIndex(model, optimizers)
    return parsed


def _plain(row: Sequence[Any]) -> dict[str, Any]:
    """A row's ``PieceLocation.to_plain`` form (raises ValueError, TypeError for a malformed one)."""
    key, box, *chunk = row
    if not isinstance(box, str):
        raise TypeError(f"not a piece row: {row!r}")
    spans = [[int(bound) for bound in span.split(":")] for span in box.split(",")] if box else []
    if any(len(span) != 2 for span in spans) or len(chunk) not in (0, 2):
        raise ValueError(f"not a piece row: {row!r}")
    return {"key": key, "box": spans, "chunk": chunk or None}


def file_index(payload: Any, file: Path, shapes: dict[str, Any]) -> FileIndex:
    """The pieces a loaded rank file holds, read from its records (its tensors are not touched).

    Raises:
        CheckpointError: the payload is no rank file's, or a piece has no valid location or lies outside its tensor.
    """
    if not isinstance(payload, dict) or not isinstance(payload.get("model"), list) or not isinstance(payload.get("optimizers"), list):
        raise CheckpointError(
            f"{file} is not a lightning-nnscaler rank file (no model and optimizers lists): the file is damaged; load another checkpoint"
        )
    model = [checked_location(piece, shapes, str(file)) for piece in payload["model"]]
    optimizers = [[checked_location(piece, shapes, str(file)) for piece in pieces] for pieces in payload["optimizers"]]
    return FileIndex(model, optimizers)


def checked_location(plain: Any, shapes: dict[str, Any], where: str) -> PieceLocation:
    """A saved piece's location from its plain form, checked: a key of the metadata, a box inside the tensor,
    a chunk of index >= 0 and size >= 1.

    Raises:
        CheckpointError: naming ``where`` (the file or index it comes from), the key and the box.
    """
    try:
        location = PieceLocation.from_plain(plain)
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(
            f"{where} holds a piece without a valid location ({error!r}): it is damaged; load another checkpoint"
        ) from None
    shape = shapes.get(location.state_key)
    if shape is None:
        raise CheckpointError(
            f"{where} holds a piece of {location.state_key!r}, which the metadata does not list: it is of another model; "
            "load the checkpoint it belongs to"
        )
    if not fits(location, shape):
        raise CheckpointError(
            f"{where} holds the piece {describe(location)} of {location.state_key!r}, outside its shape {list(shape)} in the metadata: "
            "it is of another model or plan; load the checkpoint it belongs to"
        )
    return location


def fits(location: PieceLocation, shape: Sequence[int]) -> bool:
    """True when the location's box lies inside a tensor of ``shape`` and its chunk (if any) is well formed."""
    if len(location.box) != len(shape):
        return False
    if any(not 0 <= start <= stop <= size for (start, stop), size in zip(location.box, shape)):
        return False
    return location.chunk is None or (location.chunk[0] >= 0 and location.chunk[1] >= 1)


def describe(location: PieceLocation) -> str:
    """``box [[0, 4], [0, 6]]`` or ``ZeRO chunk 1 (of 12 elements) of box [[0, 4], [0, 6]]``."""
    box = f"box {[list(span) for span in location.box]}"
    return box if location.chunk is None else f"ZeRO chunk {location.chunk[0]} (of {location.chunk[1]} elements) of {box}"
