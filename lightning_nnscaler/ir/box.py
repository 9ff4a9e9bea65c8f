"""Boxes as plain data, and where a piece lies in its full tensor (``PieceLocation``).

A box is ``IndexMask.ranges`` without the class: per dim a half-open range ``(start, stop)``. It
is what the materialized program, the generated per-rank code, the runtime and the checkpoint
files carry. A piece the optimizer updates is such a box of a parameter or, under ZeRO, one flat
chunk of it: the box flattened and zero-padded to ``len(ranks) * size`` elements, chunk ``index``
being elements ``[index * size, (index + 1) * size)`` (``runtime.reducer``'s layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Optional

if TYPE_CHECKING:
    import torch

Box = tuple[tuple[int, int], ...]


def full_box(shape: Iterable[int]) -> Box:
    """The box that covers a whole tensor of ``shape``."""
    return tuple((0, size) for size in shape)


def region(box: Iterable[Iterable[int]]) -> tuple[slice, ...]:
    """The slices that cut ``box`` out of a tensor of the full shape."""
    return tuple(slice(start, stop) for start, stop in box)


@dataclass(frozen=True)
class PieceLocation:
    """Where a piece lies in its full tensor: a box of it, or (ZeRO) a flat chunk of such a box.

    Hashable and comparable: the box and chunk are normalized to tuples of ints, whatever
    sequences they were given as (generated code and ``from_plain`` hand over lists).
    """

    state_key: str
    """The full tensor's state_dict key."""
    box: Box
    """The box of the full tensor this piece is (or, under ZeRO, was cut from)."""
    chunk: Optional[tuple[int, int]] = None
    """ZeRO only: ``(index, size)``: elements ``[index * size, (index + 1) * size)`` of the box
    flattened and zero-padded."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "box", tuple((int(start), int(stop)) for start, stop in self.box))
        if self.chunk is not None:
            index, size = self.chunk
            object.__setattr__(self, "chunk", (int(index), int(size)))

    @property
    def shape(self) -> tuple[int, ...]:
        """The piece's own shape: the box's, or ``(size,)`` for a chunk."""
        if self.chunk is not None:
            return (self.chunk[1],)
        return tuple(stop - start for start, stop in self.box)

    def region(self) -> tuple[slice, ...]:
        """The slices that cut this piece's box out of the full tensor."""
        return region(self.box)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This piece of ``full``, a tensor of the whole tensor's shape (a copy)."""
        values = full[self.region()]
        if self.chunk is None:
            return values.clone()
        index, size = self.chunk
        flat = values.reshape(-1)[index * size : (index + 1) * size]
        chunk = flat.new_zeros(size)  # the last chunk of a box is zero-padded
        chunk[: flat.numel()] = flat
        return chunk

    def to_plain(self) -> dict[str, Any]:
        """Lists and numbers only (``torch.load(weights_only=True)`` accepts them); the checkpoint files' form."""
        return {"key": self.state_key, "box": [list(span) for span in self.box], "chunk": list(self.chunk) if self.chunk else None}

    @classmethod
    def from_plain(cls, plain: dict[str, Any]) -> PieceLocation:
        """The inverse of ``to_plain``."""
        return cls(plain["key"], plain["box"], plain["chunk"] or None)
