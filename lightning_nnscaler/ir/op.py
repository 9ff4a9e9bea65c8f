"""Op: one call of an ATen operator (or a project op) on pieces of tensors."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from lightning_nnscaler.ir.annotation import DimAnnotation
from lightning_nnscaler.ir.tensor import VTensor

Argument = Any
"""A VTensor, a constant (number, bool, None, str, dtype, device, ...), or a list/tuple of them."""


PROLOGUE = (-1, 0)
"""The segment of a pipelined plan's step prologue: ops that need no gradient and no other segment."""

WHOLE_STEP = (0, 0)
"""The one segment of a plan that is not pipelined: one stage, one microbatch (its ops carry no segment)."""


@dataclass(frozen=True, eq=False)
class Op:
    """One operator call of the graph.

    Attributes:
        name: Unique name in its graph; pieces of a partitioned op are named ``"<origin>.<i>"``.
        target: The operator, e.g. ``"aten.linear.default"``.
        args: Positional arguments; tensors are VTensors.
        kwargs: Keyword arguments, as ``(name, value)`` pairs.
        outputs: The pieces this op writes, one per tensor output.
        annotation: The dimension annotation text, or ``None`` when the op may only be replicated.
        device: The device (rank) the op runs on, once assigned.
        no_grad: Whether it runs with gradients disabled (e.g. a recycling pass).
        origin: For a piece, the name of the op in the captured graph it came from.
        recompute: Ops of one device sharing this group number keep no activations for backward:
            their forward runs again during backward (activation checkpointing), e.g. co-shard.
        segment: ``(stage, microbatch)`` of a pipelined plan: the ops of one segment on a device
            form one function that the schedule runs forward (F) and backward (B, W) as a unit;
            ``PROLOGUE`` for ops that read only the batch and constants (no gradient), run once
            per step before any segment; ``None`` when the plan is not pipelined.
    """

    name: str
    target: str
    args: tuple[Argument, ...]
    kwargs: tuple[tuple[str, Argument], ...] = ()
    outputs: tuple[VTensor, ...] = ()
    annotation: str | None = None
    device: int | None = None
    no_grad: bool = False
    origin: str | None = None
    recompute: int | None = None
    segment: tuple[int, int] | None = None

    @functools.cached_property
    def tensor_inputs(self) -> list[VTensor]:
        """Every input piece, in argument order (lists flattened); the annotation follows this order."""
        return [value for value in _walk((self.args, tuple(v for _, v in self.kwargs))) if isinstance(value, VTensor)]

    def placed(self, device: int | None, segment: tuple[int, int] | None) -> Op:
        """This op on ``device`` in ``segment``; the same call, so it keeps its input pieces once found (a recipe places
        every piece of a large plan, often more than once)."""
        return self.evolve(device=device, segment=segment)

    def evolve(self, **changes: Any) -> Op:
        """This op with the fields in ``changes`` replaced (``dataclasses.replace``, without running ``__init__`` again:
        a recipe copies hundreds of thousands of pieces); it keeps the input pieces found unless the arguments change."""
        unknown = changes.keys() - _FIELD_NAMES
        if unknown:
            raise TypeError(f"Op has no fields {sorted(unknown)}")
        state = dict(self.__dict__)
        state.update(changes)
        if "args" in changes or "kwargs" in changes:
            state.pop("tensor_inputs", None)
        moved = object.__new__(Op)
        object.__setattr__(moved, "__dict__", state)
        return moved

    @property
    def kwargs_dict(self) -> dict[str, Argument]:
        """Keyword arguments as a dict."""
        return dict(self.kwargs)

    @property
    def dims(self) -> DimAnnotation | None:
        """The parsed annotation."""
        return None if self.annotation is None else _parse_cached(self.annotation)

    @property
    def source_name(self) -> str:
        """The captured op this op is (a piece of)."""
        return self.origin or self.name

    def map_tensor_inputs(self, replace_input: Callable[[int, VTensor], Argument]) -> tuple[tuple[Argument, ...], tuple[tuple[str, Argument], ...]]:
        """Args and kwargs with input piece ``i`` replaced by ``replace_input(i, piece)``."""
        counter = iter(range(1 << 30))

        def substitute(value: Argument) -> Argument:
            if isinstance(value, VTensor):
                return replace_input(next(counter), value)
            if isinstance(value, (list, tuple)):
                return type(value)(substitute(item) for item in value)
            return value

        args = tuple(substitute(arg) for arg in self.args)
        kwargs = tuple((key, substitute(value)) for key, value in self.kwargs)
        return args, kwargs


def _walk(value: Argument) -> Iterator[Argument]:
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _walk(item)
    else:
        yield value


@functools.lru_cache(maxsize=4096)
def _parse_cached(text: str) -> DimAnnotation:
    return DimAnnotation.parse(text)


@functools.lru_cache(maxsize=1024)
def resolve_target(target: str) -> Callable[..., Any]:
    """The callable behind a target name such as ``"aten.linear.default"``."""
    namespace, name, overload = target.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


_FIELD_NAMES = frozenset(field.name for field in dataclasses.fields(Op))
