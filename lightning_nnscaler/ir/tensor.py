"""Logical tensors (PTensor) and their pieces (VTensor = IndexMask + ValueMask).

A PTensor is a full logical tensor of the traced model. A VTensor is the part of it one op piece
reads or writes: a box of indices (``IndexMask``, per dim ``[start, stop)``) and a share of its
value (``ValueMask``, part ``k`` of ``n``: the pieces of a value split add up to the tensor).
Two pieces depend on each other iff they belong to the same PTensor and their masks overlap.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Literal

from lightning_nnscaler.ir.box import Box, full_box

TensorRole = Literal["input", "parameter", "buffer", "constant", "activation"]
TENSOR_ROLES: tuple[str, ...] = ("input", "parameter", "buffer", "constant", "activation")
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "bool": 1, "int8": 1, "uint8": 1}


FLOATING = frozenset({"float16", "bfloat16", "float32", "float64", "complex64", "complex128"})
"""The dtype names of floating (and complex) tensors: those that carry gradients."""


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name (4 for names not listed)."""
    return DTYPE_BYTES.get(dtype, 4)


@dataclass(frozen=True)
class PTensor:
    """A full logical tensor of the graph.

    Attributes:
        name: Unique name in its graph.
        shape: Full shape.
        dtype: Torch dtype name without the ``torch.`` prefix, e.g. ``"float32"``.
        role: Where its value comes from: a user input, a parameter, a buffer, a lifted constant,
            or an activation produced by an op.
        state_key: For parameters and buffers, the module's ``state_dict`` key.
        requires_grad: Whether gradients flow to it (parameters that train).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    role: TensorRole = "activation"
    state_key: str | None = None
    requires_grad: bool = False

    def __post_init__(self) -> None:
        if self.role not in TENSOR_ROLES:
            raise ValueError(f"tensor {self.name!r}: role {self.role!r} is not one of {TENSOR_ROLES}")

    @property
    def rank(self) -> int:
        """Number of dims."""
        return len(self.shape)

    @functools.cached_property
    def full_ranges(self) -> Box:
        """The ranges of the mask covering the whole tensor (``IndexMask.full(shape).ranges``), found once."""
        return full_box(self.shape)

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    def full(self) -> VTensor:
        """The piece that is the whole tensor."""
        return VTensor(self, IndexMask.full(self.shape), ValueMask())


_RANGE = "{0[0]}:{0[1]}"  # one range of a mask's text, ``start:stop``


@dataclass(frozen=True)
class IndexMask:
    """A box of indices: per dim a half-open range ``[start, stop)``."""

    ranges: Box

    @classmethod
    def full(cls, shape: tuple[int, ...]) -> IndexMask:
        """The mask covering a whole tensor of ``shape``."""
        return cls(full_box(shape))

    @property
    def shape(self) -> tuple[int, ...]:
        """Extent of the box per dim."""
        return tuple(stop - start for start, stop in self.ranges)

    def is_full(self, shape: tuple[int, ...]) -> bool:
        """Whether this mask covers all of a tensor of ``shape``."""
        return self.ranges == full_box(shape)  # as ``self == IndexMask.full(shape)``, without building the mask

    def split(self, dim: int, parts: int) -> list[IndexMask]:
        """Cut dim ``dim`` into ``parts`` equal contiguous ranges (the caller checks divisibility)."""
        start, stop = self.ranges[dim]
        step = (stop - start) // parts
        return [
            IndexMask(self.ranges[:dim] + ((start + i * step, start + (i + 1) * step),) + self.ranges[dim + 1 :])
            for i in range(parts)
        ]

    def intersect(self, other: IndexMask) -> IndexMask | None:
        """The common box, or ``None`` when the boxes do not overlap."""
        ranges = []
        for (a_start, a_stop), (b_start, b_stop) in zip(self.ranges, other.ranges, strict=True):
            start, stop = max(a_start, b_start), min(a_stop, b_stop)
            if start >= stop:
                return None
            ranges.append((start, stop))
        return IndexMask(tuple(ranges))

    def slices_within(self, outer: IndexMask) -> tuple[slice, ...]:
        """Slices that cut this box out of a tensor holding the box ``outer``."""
        return tuple(
            slice(start - outer_start, stop - outer_start)
            for (start, stop), (outer_start, _) in zip(self.ranges, outer.ranges, strict=True)
        )

    def __str__(self) -> str:
        return "[" + ", ".join(map(_RANGE.format, self.ranges)) + "]"


@dataclass(frozen=True)
class ValueMask:
    """Part ``part`` of ``parts`` of a value split: the ``parts`` pieces add up to the value."""

    part: int = 0
    parts: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.part < self.parts:
            raise ValueError(f"value part {self.part} is outside 0..{self.parts - 1}")

    @property
    def is_full(self) -> bool:
        """Whether the piece holds the whole value (not a partial sum)."""
        return self.parts == 1

    def split(self, parts: int) -> list[ValueMask]:
        """Split this share into ``parts`` finer shares."""
        return [ValueMask(self.part * parts + i, self.parts * parts) for i in range(parts)]

    def __str__(self) -> str:
        return f"{{{self.part}/{self.parts}}}"


@dataclass(frozen=True)
class VTensor:
    """A piece of a PTensor: the indices ``index`` and the value share ``value``."""

    tensor: PTensor
    index: IndexMask
    value: ValueMask = field(default_factory=ValueMask)

    @property
    def name(self) -> str:
        """Name of the PTensor this is a piece of."""
        return self.tensor.name

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the piece."""
        return self.index.shape

    @property
    def nbytes(self) -> int:
        """Bytes of the piece's elements."""
        return math.prod(self.shape) * dtype_bytes(self.tensor.dtype)

    @property
    def is_full(self) -> bool:
        """Whether the piece is the whole tensor with its whole value."""
        return self.index.ranges == self.tensor.full_ranges and self.value.is_full

    def split_dim(self, dim: int, parts: int) -> list[VTensor]:
        """Pieces cutting dim ``dim`` into ``parts``."""
        return [VTensor(self.tensor, index, self.value) for index in self.index.split(dim, parts)]

    def split_value(self, parts: int) -> list[VTensor]:
        """Pieces holding ``parts`` partial sums of this piece."""
        return [VTensor(self.tensor, self.index, value) for value in self.value.split(parts)]

    def overlaps(self, other: VTensor) -> bool:
        """Whether two pieces share data (same PTensor, overlapping indices)."""
        return self.tensor.name == other.tensor.name and self.index.intersect(other.index) is not None

    def __str__(self) -> str:
        text = f"%{self.tensor.name}"
        if self.index.ranges != self.tensor.full_ranges:
            text += str(self.index)
        if not self.value.is_full:
            text += str(self.value)
        return text


def covers_exactly(wanted: IndexMask, sources: list[tuple[IndexMask, ValueMask]]) -> bool:
    """Whether the sources' value shares add up to exactly one whole on every element of ``wanted``.

    Checked on the cells that the sources' boundaries cut ``wanted`` into (no dense arrays), with
    exact fractions.
    """
    from fractions import Fraction
    from itertools import product

    boxes = [(index.intersect(wanted), Fraction(1, value.parts)) for index, value in sources]
    boxes = [(box, share) for box, share in boxes if box is not None]
    if not boxes:
        return False
    cuts = []
    for dim, (start, stop) in enumerate(wanted.ranges):
        points = {start, stop} | {point for box, _ in boxes for point in box.ranges[dim]}
        ordered = sorted(points)
        cuts.append(list(zip(ordered, ordered[1:])))
    for cell in product(*cuts):
        total = sum((share for box, share in boxes if all(lo <= a and b <= hi for (a, b), (lo, hi) in zip(cell, box.ranges))), Fraction(0))
        if total != 1:
            return False
    return True
