"""The dimension annotation language: which dims of an op's tensors may be partitioned, and how.

One line per op, e.g. ``"b s k+, n k+, n -> b s n; value 0 2"`` for ``linear(x, weight, bias)``:

- a name (``b``, ``s``, ``k``) labels a dim; every tensor carrying the same name is split alike;
- ``k+`` marks a reduction dim: splitting it leaves the outputs as value parts (partial sums);
- ``h^`` marks a dim that must not be split;
- ``(h d)`` is one dim made of several names (row-major); only its first name may be split;
- a number is a fixed-size dim that is never split (``1`` for a broadcast dim);
- ``()`` is a 0-d tensor (``"b+, b+ -> ()"``); an empty output side also means one 0-d output;
- ``; value 0 2`` lists the inputs the op is linear in, jointly: splitting the op by value splits
  these inputs by value, and splitting a reduction dim value-splits those of them that lack it.
  Without it the op cannot be split by value.

Tensor specs follow the op's tensor arguments in order (lists such as ``cat``'s are flattened).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from lightning_nnscaler.ir.errors import NnScalerError

_TOKEN = re.compile(r"\(|\)|[A-Za-z_][A-Za-z0-9_']*[+^]?|\d+")


class AnnotationError(NnScalerError, ValueError):
    """An annotation does not parse, or does not fit the shapes it is applied to."""


@dataclass(frozen=True)
class DimSpec:
    """One dim of one tensor: named (one name, or several for a merged dim) or of fixed size."""

    names: tuple[str, ...] = ()
    size: int | None = None

    def __str__(self) -> str:
        if self.size is not None:
            return str(self.size)
        return self.names[0] if len(self.names) == 1 else "(" + " ".join(self.names) + ")"


TensorSpec = tuple[DimSpec, ...]


@dataclass(frozen=True)
class DimAnnotation:
    """A parsed annotation; ``str()`` gives the text back."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    reduced: frozenset[str] = frozenset()
    frozen: frozenset[str] = frozenset()
    value_inputs: tuple[int, ...] = ()

    @classmethod
    def parse(cls, text: str) -> DimAnnotation:
        """Parse the annotation language (see the module docstring)."""
        body, _, value_clause = text.partition(";")
        if "->" not in body:
            raise AnnotationError(f"annotation {text!r} has no '->'")
        left, right = body.split("->", 1)
        reduced: set[str] = set()
        frozen: set[str] = set()
        inputs = tuple(_parse_tensor(part, reduced, frozen, text) for part in _split_tensors(left))
        outputs = tuple(_parse_tensor(part, reduced, frozen, text) for part in _split_tensors(right) or [""])
        value_inputs = _parse_value_clause(value_clause, len(inputs), text)
        return cls(inputs, outputs, frozenset(reduced), frozenset(frozen), value_inputs)

    def __str__(self) -> str:
        def tensor_text(spec: TensorSpec) -> str:
            return " ".join(self._mark(str(dim)) for dim in spec) or "()"

        text = ", ".join(map(tensor_text, self.inputs)) + " -> " + ", ".join(map(tensor_text, self.outputs))
        if self.value_inputs:
            text += "; value " + " ".join(map(str, self.value_inputs))
        return text

    def _mark(self, dim_text: str) -> str:
        if dim_text in self.reduced:
            return dim_text + "+"
        if dim_text in self.frozen:
            return dim_text + "^"
        return dim_text

    @property
    def names(self) -> list[str]:
        """Every dim name, in order of first appearance."""
        seen: dict[str, None] = {}
        for spec in self.inputs + self.outputs:
            for dim in spec:
                for name in dim.names:
                    seen.setdefault(name, None)
        return list(seen)

    def splittable_names(self) -> list[str]:
        """Names that may be split: not frozen and never the inner part of a merged dim."""
        inner = {name for spec in self.inputs + self.outputs for dim in spec for name in dim.names[1:]}
        return [name for name in self.names if name not in self.frozen and name not in inner]

    def name_sizes(self, input_shapes: list[tuple[int, ...]], output_shapes: list[tuple[int, ...]]) -> dict[str, int]:
        """Size of every name, read off the shapes; raises when the shapes disagree with the text."""
        specs = list(self.inputs) + list(self.outputs)
        shapes = list(input_shapes) + list(output_shapes)
        if len(specs) != len(shapes):
            raise AnnotationError(f"annotation {self} has {len(specs)} tensors, the op has {len(shapes)}")
        sizes: dict[str, int] = {}
        merged: list[tuple[DimSpec, int]] = []
        for spec, shape in zip(specs, shapes):
            if len(spec) != len(shape):
                raise AnnotationError(f"annotation {self}: tensor spec {' '.join(map(str, spec))!r} has {len(spec)} dims, tensor has shape {tuple(shape)}")
            for dim, size in zip(spec, shape):
                if dim.size is not None:
                    if dim.size != size:
                        raise AnnotationError(f"annotation {self}: fixed dim {dim.size} meets size {size}")
                elif len(dim.names) == 1:
                    if sizes.setdefault(dim.names[0], size) != size:
                        raise AnnotationError(f"annotation {self}: {dim.names[0]!r} has sizes {sizes[dim.names[0]]} and {size}")
                else:
                    merged.append((dim, size))
        for dim, size in merged:
            unknown = [name for name in dim.names if name not in sizes]
            known = 1
            for name in dim.names:
                known *= sizes.get(name, 1)
            if len(unknown) == 1 and size % known == 0:
                sizes[unknown[0]] = size // known
            elif unknown or known != size:
                raise AnnotationError(f"annotation {self}: merged dim {dim} does not fit size {size}")
        return sizes


def _split_tensors(side: str) -> list[str]:
    parts = [part.strip() for part in side.split(",")]
    return [] if parts == [""] else ["" if part == "()" else part for part in parts]


def _parse_tensor(text: str, reduced: set[str], frozen: set[str], whole: str) -> TensorSpec:
    dims: list[DimSpec] = []
    group: list[str] | None = None
    consumed = "".join(_TOKEN.findall(text))
    if consumed != text.replace(" ", ""):
        raise AnnotationError(f"annotation {whole!r}: cannot read {text!r}")
    for token in _TOKEN.findall(text):
        if token == "(":
            if group is not None:
                raise AnnotationError(f"annotation {whole!r}: nested '('")
            group = []
        elif token == ")":
            if not group:
                raise AnnotationError(f"annotation {whole!r}: empty or unopened group")
            dims.append(DimSpec(tuple(group)))
            group = None
        elif token.isdigit():
            if group is not None:
                raise AnnotationError(f"annotation {whole!r}: a number inside a merged dim")
            dims.append(DimSpec(size=int(token)))
        else:
            name = token.rstrip("+^")
            if token.endswith("+"):
                reduced.add(name)
            elif token.endswith("^"):
                frozen.add(name)
            if group is not None:
                group.append(name)
            else:
                dims.append(DimSpec((name,)))
    if group is not None:
        raise AnnotationError(f"annotation {whole!r}: unclosed '('")
    return tuple(dims)


def _parse_value_clause(clause: str, input_count: int, whole: str) -> tuple[int, ...]:
    words = clause.split()
    if not words:
        return ()
    if words[0] != "value" or not all(word.isdigit() for word in words[1:]):
        raise AnnotationError(f"annotation {whole!r}: expected '; value <input indices>'")
    indices = tuple(int(word) for word in words[1:])
    if any(index >= input_count for index in indices):
        raise AnnotationError(f"annotation {whole!r}: value input out of range (the op has {input_count} inputs)")
    return indices
