"""Where pieces of one tensor overlap, and one wanted piece put together from the saved pieces it overlaps.

A piece is a box of the full tensor or a ZeRO chunk of one (``ir.box.PieceLocation``). A chunk ``(index, size)``
of a box is a range of the box's row-major flattening; such a range is the concatenation of at most
``2 * ndim - 1`` boxes (``flat_range_boxes``). Every saved and wanted piece is turned into such boxes, each
with its offset in the piece's flat values, and box meets box.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Sequence

import torch

from lightning_nnscaler.checkpoint.index import describe
from lightning_nnscaler.checkpoint.integrity import CheckpointError
from lightning_nnscaler.ir.box import Box, PieceLocation, region

Source = tuple[PieceLocation, Callable[[], torch.Tensor], str]
"""A saved piece: its location, its values (shaped like the location, read lazily) and the file holding it."""


def flat_range_boxes(box: Box, start: int, stop: int) -> list[Box]:
    """The boxes whose row-major flattenings, concatenated, are elements ``[start, stop)`` of ``box`` flattened."""
    if start >= stop:
        return []
    if not box:  # a scalar: one element
        return [()]
    first, rest = box[0][0], box[1:]
    if not rest:
        return [((first + start, first + stop),)]
    inner = math.prod(high - low for low, high in rest)
    row, offset = divmod(start, inner)
    end_row, end_offset = divmod(stop, inner)
    if row == end_row:
        return [((first + row, first + row + 1), *sub) for sub in flat_range_boxes(rest, offset, end_offset)]
    boxes = []
    if offset:
        boxes += [((first + row, first + row + 1), *sub) for sub in flat_range_boxes(rest, offset, inner)]
        row += 1
    if end_row > row:
        boxes.append(((first + row, first + end_row), *rest))
    if end_offset:
        boxes += [((first + end_row, first + end_row + 1), *sub) for sub in flat_range_boxes(rest, 0, end_offset)]
    return boxes


def value_boxes(location: PieceLocation) -> list[tuple[Box, int]]:
    """The boxes of the full tensor a piece's values are, each with its offset in the piece's flat values
    (a box: itself at 0; a ZeRO chunk: the boxes of its flat range, its zero padding in none)."""
    if location.chunk is None:
        return [(location.box, 0)]
    index, size = location.chunk
    numel = _numel(location.box)
    boxes, offset = [], 0
    for box in flat_range_boxes(location.box, min(index * size, numel), min((index + 1) * size, numel)):
        boxes.append((box, offset))
        offset += _numel(box)
    return boxes


def overlaps(wanted: PieceLocation, saved: PieceLocation) -> bool:
    """True when some element of the full tensor lies in both pieces."""
    if _meet(wanted.box, saved.box) is None:
        return False
    return any(_meet(mine, theirs) is not None for mine, _ in value_boxes(wanted) for theirs, _ in value_boxes(saved))


def gather(wanted: PieceLocation, sources: Sequence[Source], dtype: torch.dtype, what: str) -> tuple[torch.Tensor, int]:
    """The values of ``wanted`` (a ZeRO chunk's padding zero) from the overlapping ``sources``, and the bytes copied.

    Only the overlap of each source is copied (a slice of a memory-mapped tensor: its pages alone are read);
    an element already copied from another source is not copied again.

    Raises:
        CheckpointError: the sources do not cover every element of ``wanted`` (``what`` names the tensor).
    """
    values = torch.zeros(wanted.shape, dtype=dtype)
    covered = torch.ones(wanted.shape, dtype=torch.bool)
    flat_values, flat_covered = values.view(-1), covered.view(-1)
    copied = 0
    for box, offset in value_boxes(wanted):
        shape = _shape(box)
        target = flat_values[offset : offset + _numel(box)].view(shape)
        done = flat_covered[offset : offset + _numel(box)].view(shape)
        done.fill_(False)
        for saved, read, _ in sources:
            copied += _copy_overlaps(box, target, done, saved, read)
    if not bool(covered.all()):
        raise _uncovered(wanted, covered, sources, what)
    return values, copied


def _copy_overlaps(box: Box, target: torch.Tensor, done: torch.Tensor, saved: PieceLocation, read: Callable[[], torch.Tensor]) -> int:
    """Copy the parts of ``saved`` inside ``box`` into ``target`` (``box``'s values), marking them ``done``; the bytes copied."""
    copied = 0
    for saved_box, offset in value_boxes(saved):
        overlap = _meet(box, saved_box)
        if overlap is None:
            continue
        inside = _relative(overlap, box)
        if bool(done[inside].all()):
            continue
        stored = read()
        if saved.chunk is not None:
            stored = stored[offset : offset + _numel(saved_box)].reshape(_shape(saved_box))
        part = stored[_relative(overlap, saved_box)]
        target[inside] = part
        done[inside] = True
        copied += part.numel() * part.element_size()
    return copied


def _uncovered(wanted: PieceLocation, covered: torch.Tensor, sources: Sequence[Source], what: str) -> CheckpointError:
    missing = int((~covered).sum())
    first = [int(index) for index in (~covered).nonzero()[0]]
    where = (
        f"element {[low + index for (low, _), index in zip(wanted.box, first)]} of the tensor"
        if wanted.chunk is None else f"element {first[0]} of the chunk"
    )
    files = sorted({file for _, _, file in sources}) or ["none"]
    return CheckpointError(
        f"{what}: the saved pieces do not cover the wanted {describe(wanted)} ({missing} of its {covered.numel()} elements "
        f"are in no piece, e.g. {where}; files with overlapping pieces: {', '.join(files)}). The checkpoint lacks part of this "
        "tensor (the saving plan did not hold it, or a rank file lost it): load another checkpoint"
    )


def _meet(first: Box, second: Box) -> Box | None:
    """The intersection of two boxes of one tensor, or None when it is empty."""
    met = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(first, second))
    return met if all(low < high for low, high in met) else None


def _relative(inner: Box, outer: Box) -> tuple[slice, ...]:
    """The slices that cut ``inner`` out of a tensor holding ``outer``."""
    return region((low - base, high - base) for (low, high), (base, _) in zip(inner, outer))


def _shape(box: Box) -> tuple[int, ...]:
    return tuple(high - low for low, high in box)


def _numel(box: Iterable[tuple[int, int]]) -> int:
    return math.prod(high - low for low, high in box)


def scalar_state(value: Any) -> Any:
    """A copy of a state entry that is not per element (a tensor detached from the memory map)."""
    return value.clone() if isinstance(value, torch.Tensor) else value
