"""Per-step values while ``training_step`` is traced: arithmetic lifted into the graph, decisions kept as guards.

``batch_idx``, ``self.global_step`` and ``self.current_epoch`` change every step, but the step is
traced once. While it is traced they are `StepInt`s, symbolic ints that remember how they were
computed (an `Expression` over the three *step quantities*):

* **Arithmetic stays symbolic** (``0.5 * self.global_step + 1``, ``(batch_idx + 1) / 100``,
  ``0.9 ** self.current_epoch``, with the number on either side) and where it meets a tensor
  (``loss * factor``, ``torch.tensor(step)``, ``torch.where(step > 3, ...)``) it is **lifted**: computed
  by tensor ops from a 0-d constant per quantity, which the runtime sets before every step. A warm-up
  factor is then right at every step, with one plan. Python's own number types are followed (an int
  expression computes in int64, a float one in float64, as Python's float is a double).
* **Decisions are guards**: a truth value, a comparison, ``int()`` / ``float()`` / an index / a hash
  keep their outcome at the trace as a `Guard` (``batch_idx % 100 == 0 -> False``). Before each step
  the strategy evaluates the plan's guards on the step's values, and traces and plans the step again
  for an outcome it has not planned yet (``torch.compile``'s guards, for a step instead of a frame).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

_ARITHMETIC: dict[str, Callable[..., Any]] = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
    "floordiv": operator.floordiv, "mod": operator.mod, "pow": pow, "neg": operator.neg, "pos": operator.pos, "abs": abs,
    "floor": math.floor, "ceil": math.ceil, "trunc": math.trunc, "round": round,
}
_TENSOR_ARITHMETIC: dict[str, Callable[..., Any]] = {
    **_ARITHMETIC, "floor": torch.floor, "ceil": torch.ceil, "trunc": torch.trunc, "round": torch.round,
}
_DECISIONS: dict[str, Callable[..., Any]] = {
    "eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge,
    "bool": bool, "int": int, "float": float, "index": operator.index, "hash": hash, "divmod": divmod,
    "and": operator.and_, "or": operator.or_, "xor": operator.xor, "lshift": operator.lshift, "rshift": operator.rshift,
    "invert": operator.invert,
}
_SYMBOLS = {
    "add": "+", "sub": "-", "mul": "*", "truediv": "/", "floordiv": "//", "mod": "%", "pow": "**", "eq": "==", "ne": "!=",
    "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "and": "&", "or": "|", "xor": "^", "lshift": "<<", "rshift": ">>",
}


def quantity_of(label: str) -> str:
    """The step quantity a label names: ``batch_idx``, or the last part of ``self.trainer.global_step``."""
    return label if label == "batch_idx" else label.rsplit(".", 1)[-1]


@dataclass(frozen=True)
class Expression:
    """How a per-step value is computed from the step quantities: a leaf (``operation == "leaf"``, its
    ``label`` as the user's code names it) or an operation over expressions and plain numbers."""

    operation: str
    operands: tuple[Any, ...] = ()
    label: str = ""

    def evaluate(self, values: Mapping[str, int]) -> Any:
        """The value at step quantities ``values`` (Python's own arithmetic)."""
        if self.operation == "leaf":
            return values[quantity_of(self.label)]
        function = _ARITHMETIC.get(self.operation) or _DECISIONS[self.operation]
        return function(*(operand.evaluate(values) if isinstance(operand, Expression) else operand for operand in self.operands))

    def tensor(self, leaves: Mapping[str, torch.Tensor], values: Mapping[str, int]) -> torch.Tensor:
        """The value as a 0-d tensor computed from the quantities' ``leaves`` (int64 for an int, float64 for a float)."""
        if self.operation == "leaf":
            return leaves[quantity_of(self.label)]
        dtype = torch.float64 if isinstance(self.evaluate(values), float) else torch.int64
        operands = [_as(operand.tensor(leaves, values), dtype) if isinstance(operand, Expression) else operand for operand in self.operands]
        return _as(_TENSOR_ARITHMETIC[self.operation](*operands), dtype)

    def __str__(self) -> str:
        if self.operation == "leaf":
            return self.label
        if self.operation in _SYMBOLS and len(self.operands) == 2:
            texts = [f"({operand})" if isinstance(operand, Expression) and operand.operation != "leaf" else str(operand) for operand in self.operands]
            return f"{texts[0]} {_SYMBOLS[self.operation]} {texts[1]}"
        return f"{self.operation}({', '.join(map(str, self.operands))})"

    def labels(self) -> set[str]:
        """The leaves' labels."""
        if self.operation == "leaf":
            return {self.label}
        return set().union(*(operand.labels() for operand in self.operands if isinstance(operand, Expression)))


def _as(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


@dataclass(frozen=True)
class Guard:
    """A decision the traced step made on per-step values: ``expression`` evaluated to ``outcome``."""

    expression: Expression
    outcome: Any
    location: str

    def holds(self, values: Mapping[str, int]) -> bool:
        """Whether the step would decide the same at step quantities ``values``."""
        now = self.expression.evaluate(values)
        return type(now) is type(self.outcome) and now == self.outcome

    def __str__(self) -> str:
        return f"{self.expression} -> {self.outcome!r} (at {self.location})"


class StepWatchProtocol(Protocol):
    """What a `StepInt` reports to (``step_values.StepWatch``)."""

    def guard(self, expression: Expression, outcome: Any) -> None: ...

    def lift(self, value: StepInt, beside: torch.Tensor | None = None) -> torch.Tensor: ...


class StepInt:
    """A per-step int while the step is traced: arithmetic gives `StepInt`s, decisions are guards, and a
    tensor operation gets it lifted into the graph (see the module docstring)."""

    __slots__ = ("_value", "_expression", "_watch")

    def __init__(self, value: Any, expression: Expression, watch: StepWatchProtocol) -> None:
        self._value, self._expression, self._watch = value, expression, watch

    @property
    def _label(self) -> str:
        return str(self._expression)

    def __reduce__(self) -> tuple[type, tuple[Any]]:
        return type(self._value), (self._value,)

    def __str__(self) -> str:
        return str(self._value)

    def __repr__(self) -> str:
        return repr(self._value)

    def __format__(self, spec: str) -> str:
        return format(self._value, spec)

    def decide(self, operation: str, *others: Any) -> Any:
        """``operation`` on the traced value: its outcome, kept as a guard."""
        operands = (self._expression, *(other._expression if isinstance(other, StepInt) else other for other in others))
        outcome = _DECISIONS[operation](self._value, *(plain(other) for other in others))
        self._watch.guard(Expression(operation, operands), outcome)
        return outcome


def plain(value: Any) -> Any:
    """The traced value of a `StepInt`; anything else as it is."""
    return value._value if isinstance(value, StepInt) else value


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, StepInt)


def _arithmetic(operation: str, reflected: bool) -> Callable[..., Any]:
    function = _ARITHMETIC[operation]

    def method(self: StepInt, *others: Any) -> Any:
        tensors = [other for other in others if isinstance(other, torch.Tensor)]
        if tensors:
            lifted = self._watch.lift(self, tensors[0])
            return function(*others, lifted) if reflected else function(lifted, *others)
        if not all(_number(other) or isinstance(other, StepInt) for other in others):  # e.g. a list repeated step times
            concrete = self.decide("float" if isinstance(self._value, float) else "int")
            return function(*others, concrete) if reflected else function(concrete, *others)
        operands = [other._expression if isinstance(other, StepInt) else other for other in others]
        values = [plain(other) for other in others]
        expression = Expression(operation, (*operands, self._expression) if reflected else (self._expression, *operands))
        value = function(*values, self._value) if reflected else function(self._value, *values)
        return StepInt(value, expression, self._watch)

    method.__name__ = f"__{'r' if reflected else ''}{operation}__"
    return method


def _decision(operation: str) -> Callable[..., Any]:
    def method(self: StepInt, *others: Any) -> Any:
        tensors = [other for other in others if isinstance(other, torch.Tensor)]
        if tensors:
            return _DECISIONS[operation](self._watch.lift(self, tensors[0]), *others)
        return self.decide(operation, *others)

    method.__name__ = f"__{operation}__"
    return method


def _reflected_decision(operation: str) -> Callable[..., Any]:
    def method(self: StepInt, other: Any) -> Any:
        return _DECISIONS[operation](other, self.decide("index"))

    method.__name__ = f"__r{operation}__"
    return method


for _operation in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow"):
    setattr(StepInt, f"__{_operation}__", _arithmetic(_operation, reflected=False))
    setattr(StepInt, f"__r{_operation}__", _arithmetic(_operation, reflected=True))
for _operation in ("neg", "pos", "abs", "floor", "ceil", "trunc"):
    setattr(StepInt, f"__{_operation}__", _arithmetic(_operation, reflected=False))
for _operation in ("eq", "ne", "lt", "le", "gt", "ge", "bool", "int", "float", "index", "hash", "invert", "divmod", "and", "or", "xor", "lshift", "rshift"):
    setattr(StepInt, f"__{_operation}__", _decision(_operation))
for _operation in ("divmod", "and", "or", "xor", "lshift", "rshift"):
    setattr(StepInt, f"__r{_operation}__", _reflected_decision(_operation))


def _round(self: StepInt, digits: Any = None) -> Any:
    if digits is None:
        return StepInt(round(self._value), Expression("round", (self._expression,)), self._watch)
    return round(self.decide("float") if isinstance(self._value, float) else self.decide("int"), digits)


StepInt.__round__ = _round  # type: ignore[attr-defined]
