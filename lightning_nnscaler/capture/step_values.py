"""Python values that a captured ``training_step`` would freeze: refused at tracing, or checked every step.

``NnScalerStrategy`` traces ``training_step`` once, on the first batch, and then runs the captured
tensor computation on every batch. The step's Python runs only at that trace, so whatever it
computes from a value that changes between steps keeps the first step's result: ``if batch_idx % 2``,
``if self.global_step > 3``, ``loss * self.current_epoch``, ``if self.calls > 0``. This module turns
each of these into a `FrozenValueError` instead of silently wrong training.

**Per-step values** are refused at tracing. While the step is traced, ``batch_idx``,
``self.global_step`` and ``self.current_epoch`` (on every LightningModule of the tree), and
``self.trainer.global_step`` / ``self.trainer.current_epoch`` (when a Trainer is attached; without
one the module's properties are 0, as Lightning defines them) are `StepInt`s: int-like values that
record every use that can change the computation: truth value, comparisons, arithmetic with the
number on either side (``0.5 * self.global_step``, ``2.0 ** batch_idx``), hashing (a dict key),
``__index__`` / ``__int__`` / ``__float__`` / rounding conversions, and being passed to any torch
function (a ``TorchFunctionMode`` sees each torch call of the step, ``torch.tensor(step)`` included).
Formatting (``str``, ``repr``, f-strings) is not a use: a name such as ``f"loss_{batch_idx}"`` cannot
change the loss, and ``self.log`` does nothing while tracing. An operation on a `StepInt` returns a
plain value: the operation itself is already the recorded use.

**Plain attributes** are checked every step. The rule: a read, during the trace, of an attribute
that is in a module's instance ``__dict__`` (not a property, class attribute, method, parameter,
buffer or submodule) and whose value's type is exactly ``bool``, ``int``, ``float`` or ``str``, on
the traced module or any submodule, is recorded with its value in a `StepValues`;
``StepValues.check(module)`` (the strategy calls it before every step) raises `FrozenValueError` when
one of them has changed. Exempt, because the frameworks manage them: names that a bare ``nn.Module()``
or ``LightningModule()`` sets in ``__init__`` (``training``, ``prepare_data_per_node``,
``_current_fx_name``, ...), and private names (``_x``) that a method of a torch or Lightning class in
the module's MRO uses (``MultiheadAttention._qkv_same_embed_dim``); ``hparams`` is a property and
not recorded. A step that *assigns* such an attribute (``self.calls += 1``) is refused at tracing:
the assignment would happen once, at the trace, and never again (the trace puts the old value back).

Not seen: attributes of other objects (``self.config.dropout``, ``self.trainer.max_epochs``), module
globals and class attributes; ``isinstance(batch_idx, int)`` is False while tracing (it is a
``numbers.Integral``). A plain attribute read only to be logged still counts as read.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import operator
import os
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from lightning_nnscaler.capture.convert import CaptureError

_SCALARS = (bool, int, float, str)
_UNSET = object()
_FRAMEWORK_PACKAGES = ("torch", "lightning", "lightning_fabric", "pytorch_lightning")
_TORCH_DIRECTORY = os.path.dirname(torch.__file__) + os.sep
_CAPTURE_DIRECTORY = os.path.dirname(os.path.abspath(__file__)) + os.sep
_FIX = (
    "NnScalerStrategy traces training_step once, on the first batch, and runs that captured computation on every "
    "batch, so the step would go on computing with the first step's value. Compute such a value outside the step and "
    "pass it in as a tensor of the batch (e.g. `on_after_batch_transfer` appends "
    "`torch.full((batch_size,), float(self.current_epoch))`), then use tensor ops (`loss * (1 + epoch)`, "
    "`torch.where(step > 3, a, b)` for a branch); do Python-side work (printing, counters) in a hook such as "
    "on_train_batch_start or on_train_epoch_start, which runs every step."
)


class FrozenValueError(CaptureError):
    """A Python value that changes between steps would be frozen into the captured ``training_step``."""


@dataclass(frozen=True)
class FrozenAttribute:
    """A plain attribute the traced step read: ``path`` is the submodule (``""``: the module itself)."""

    path: str
    name: str
    value: bool | int | float | str
    location: str

    @property
    def label(self) -> str:
        """How the user's code names it: ``self.calls``, ``self.encoder.dropout.p``."""
        return ".".join(["self", *filter(None, [self.path]), self.name])

    def current(self, module: nn.Module) -> Any:
        """The attribute's value on ``module`` now (``"<deleted>"`` when it is gone).

        Read straight from ``_modules`` and the instance ``__dict__`` (where the rule records it
        from), ten times faster than ``get_submodule`` + ``getattr``: the reference GPT's 27
        attributes take about 60 µs a step.
        """
        owner: nn.Module | None = module
        for part in self.path.split(".") if self.path else ():
            owner = owner._modules.get(part)
            if owner is None:
                return "<deleted>"
        state = vars(owner)
        return state[self.name] if self.name in state else getattr(owner, self.name, "<deleted>")


@dataclass(frozen=True)
class StepValues:
    """The plain attributes the traced ``training_step`` read, with their values at tracing."""

    attributes: tuple[FrozenAttribute, ...] = ()

    def check(self, module: nn.Module) -> None:
        """Raise unless every attribute the step read still has its traced value (a few getattr).

        Raises:
            FrozenValueError: naming the attribute, its traced and current values, and the fix.
        """
        for attribute in self.attributes:
            current = attribute.current(module)
            if not _same(current, attribute.value):
                raise FrozenValueError(
                    f"{type(module).__name__}.training_step read {attribute.label} (at {attribute.location}), which was "
                    f"{attribute.value!r} when the step was traced and is {current!r} now. {_FIX} Or keep "
                    f"{attribute.label} constant during training."
                )


def _same(current: Any, traced: Any) -> bool:
    """Equal and of the same type (``1``, ``1.0`` and ``True`` differ; NaN equals NaN)."""
    if type(current) is not type(traced):
        return False
    return current == traced or (isinstance(traced, float) and math.isnan(traced) and math.isnan(current))


class StepInt:
    """An int that changes between steps; every use that can change the computation is recorded.

    Not an ``int`` subclass: ``0.5 * step`` and ``2.0 ** step`` would then be computed by ``float``'s
    own methods, which read an int subclass's value in C and never call it. As a plain object it gets
    the reflected call (``__rmul__``, ``__rpow__``, ...), and ``__index__`` makes it work wherever an
    int is needed (``range``, list indices, ``torch.tensor``), each of which is a recorded use.
    """

    __slots__ = ("_value", "_label", "_watch")

    def __init__(self, value: int, label: str, watch: StepWatch) -> None:
        """``value`` named ``label`` (``batch_idx``, ``self.global_step``) reporting its uses to ``watch``."""
        self._value, self._label, self._watch = int(value), label, watch

    def __reduce__(self) -> tuple[type, tuple[int]]:
        return int, (self._value,)

    def __str__(self) -> str:
        return str(self._value)

    def __repr__(self) -> str:
        return repr(self._value)

    def __format__(self, spec: str) -> str:
        return format(self._value, spec)


numbers.Integral.register(StepInt)


def _plain(value: Any) -> Any:
    return value._value if isinstance(value, StepInt) else value


def _recording(name: str, compute: Callable[..., Any]) -> Callable[..., Any]:
    def method(self: StepInt, *args: Any) -> Any:
        self._watch.record_use(self._label)
        return compute(self._value, *map(_plain, args))

    method.__name__ = f"__{name}__"
    return method


# Every int operation whose result depends on the value; formatting (__str__, __repr__, __format__) is
# left out. Binary operations compute as Python's operators do on the plain int (so ``step == 0.0`` and
# ``0.5 + step`` mix types as ints do); the reflected ones swap the operands.
_UNARY = "bool hash index int float round trunc floor ceil neg pos abs invert".split()
_BINARY = {
    "eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge,
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv, "floordiv": operator.floordiv,
    "mod": operator.mod, "divmod": divmod, "pow": pow, "and": operator.and_, "or": operator.or_, "xor": operator.xor,
    "lshift": operator.lshift, "rshift": operator.rshift,
}
_COMPARISONS = {"eq", "ne", "lt", "le", "gt", "ge"}
for _name in _UNARY:
    setattr(StepInt, f"__{_name}__", _recording(_name, getattr(int, f"__{_name}__")))
for _name, _operation in _BINARY.items():
    setattr(StepInt, f"__{_name}__", _recording(_name, _operation))
    if _name not in _COMPARISONS:
        setattr(StepInt, f"__r{_name}__", _recording(f"r{_name}", lambda value, other, operation=_operation: operation(other, value)))


class StepWatch:
    """What one trace of ``training_step`` used: per-step values, and plain attributes read or assigned."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.batch_idx = StepInt(0, "batch_idx", self)
        self.uses: dict[str, str] = {}  # label -> where it was first used
        self.writes: dict[str, str] = {}  # label -> where it was first assigned
        self._reads: dict[tuple[int, str], FrozenAttribute] = {}
        self._overwritten: dict[tuple[int, str], tuple[nn.Module, str, Any]] = {}  # the value before the first write
        self._paths = {id(sub): path for path, sub in module.named_modules()}

    def record_use(self, label: str) -> None:
        """A per-step value was used (called by `StepInt`)."""
        self.uses.setdefault(label, user_location())

    def record_read(self, owner: nn.Module, name: str, value: Any) -> None:
        """A plain attribute of ``owner`` was read (its first value counts)."""
        key = (id(owner), name)
        if key not in self._reads and id(owner) in self._paths:
            self._reads[key] = FrozenAttribute(self._paths[id(owner)], name, value, user_location())

    def record_write(self, owner: nn.Module, name: str) -> None:
        """A plain attribute of ``owner`` is about to be assigned (`undo_writes` puts its value back)."""
        if id(owner) in self._paths:
            self.writes.setdefault(self.label(owner, name), user_location())
            self._overwritten.setdefault((id(owner), name), (owner, name, vars(owner).get(name, _UNSET)))

    def undo_writes(self) -> None:
        """Put back the plain attributes the traced step assigned (a refused trace leaves no trace)."""
        for owner, name, value in reversed(self._overwritten.values()):
            if value is _UNSET:
                vars(owner).pop(name, None)
            else:
                vars(owner)[name] = value

    def label(self, owner: nn.Module, name: str) -> str:
        """``self.<path>.<name>`` for a module of the traced tree."""
        return FrozenAttribute(self._paths.get(id(owner), "?"), name, 0, "").label

    @contextlib.contextmanager
    def torch_calls(self) -> Iterator[None]:
        """Record per-step values passed to torch functions (``loss * step``, ``torch.tensor(step)``)."""
        with _StepIntArguments():
            yield

    def step_values(self) -> StepValues:
        """The attributes read, in the order of their first read."""
        return StepValues(tuple(self._reads.values()))

    def raise_if_frozen(self, cause: BaseException | None = None) -> None:
        """Raise if the step used a per-step value or assigned a plain attribute.

        Raises:
            FrozenValueError: naming every value, where it was used, and the fix.
        """
        problems = []
        if self.uses:
            used = ", ".join(f"{label} (at {location})" for label, location in self.uses.items())
            problems.append(f"computes with {used}, which change{'s' if len(self.uses) == 1 else ''} between steps. {_FIX}")
        if self.writes:
            written = ", ".join(f"{label} (at {location})" for label, location in self.writes.items())
            problems.append(
                f"assigns {written}: the step's Python runs once, at the trace, so the assignment would not happen on later "
                "steps. Move it to a hook such as on_train_batch_start or on_train_batch_end, which runs every step."
            )
        if problems:
            raise FrozenValueError(f"{type(self.module).__name__}.training_step " + "\nIt also ".join(problems)) from cause


class _StepIntArguments(TorchFunctionMode):
    """Sees every torch call: a `StepInt` argument is a use (torch reads ints in C, past StepInt's methods)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        for leaf in pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, StepInt):
                leaf._watch.record_use(leaf._label)
        args, kwargs = pytree.tree_map(_plain, (args, kwargs))
        return func(*args, **kwargs)


@contextlib.contextmanager
def watch_step(module: nn.Module) -> Iterator[StepWatch]:
    """While tracing ``module.training_step``: every module of the tree (and its Trainer) runs as a
    subclass that reports to the yielded `StepWatch`; the original classes are back on exit, also on error."""
    watch = StepWatch(module)
    modules = {id(sub): sub for sub in module.modules()}
    trainers = {id(trainer): trainer for sub in modules.values() if isinstance(trainer := vars(sub).get("_trainer"), Trainer)}
    swapped: list[tuple[Any, type]] = []
    subclasses: dict[type, type | None] = {}
    try:
        for sub in modules.values():
            original = type(sub)
            if original not in subclasses:
                subclasses[original] = _subclass(original, _watched_module_namespace(original, watch))
            _swap(sub, subclasses[original], swapped)
        for trainer in trainers.values():
            _swap(trainer, _subclass(type(trainer), _step_properties(type(trainer), "self.trainer", watch)), swapped)
        yield watch
    finally:
        for instance, original in reversed(swapped):
            instance.__class__ = original
        watch.undo_writes()


def _swap(instance: Any, subclass: type | None, swapped: list[tuple[Any, type]]) -> None:
    """Give ``instance`` the class ``subclass`` (skipped where Python refuses, e.g. ``__slots__`` layouts)."""
    if subclass is None:
        return
    original = type(instance)
    try:
        instance.__class__ = subclass
    except TypeError:
        return
    swapped.append((instance, original))


def _subclass(original: type, namespace: dict[str, Any]) -> type | None:
    """A subclass of ``original`` under the same names (messages and export's module stack read them)."""
    namespace = {**namespace, "__module__": original.__module__, "__qualname__": original.__qualname__, "__doc__": original.__doc__}
    try:
        return type(original)(original.__name__, (original,), namespace)
    except Exception:  # noqa: BLE001 - a class that cannot be subclassed (a metaclass or __init_subclass__ refusing) is not watched
        return None


def _watched_module_namespace(original: type, watch: StepWatch) -> dict[str, Any]:
    """``__getattribute__`` / ``__setattr__`` that record plain attributes, and the step properties."""
    base_getattribute, base_setattr = original.__getattribute__, original.__setattr__
    exempt = _framework_names(original)

    def __getattribute__(self: nn.Module, name: str) -> Any:
        value = base_getattribute(self, name)
        if type(value) in _SCALARS and name not in exempt and name in base_getattribute(self, "__dict__"):
            watch.record_read(self, name, value)
        return value

    def __setattr__(self: nn.Module, name: str, value: Any) -> None:
        if name not in exempt and (type(value) in _SCALARS or type(base_getattribute(self, "__dict__").get(name)) in _SCALARS):
            watch.record_write(self, name)
        base_setattr(self, name, value)

    namespace: dict[str, Any] = {"__getattribute__": __getattribute__, "__setattr__": __setattr__}
    if issubclass(original, LightningModule):
        namespace.update(_step_properties(original, None, watch))
    return namespace


def _step_properties(original: type, prefix: str | None, watch: StepWatch) -> dict[str, property]:
    """``global_step`` and ``current_epoch`` returning `StepInt`s labelled ``<prefix>.<name>``
    (``prefix=None``: the module's own path, ``self.global_step``)."""
    properties = {}
    for name in ("global_step", "current_epoch"):
        base = getattr(original, name, None)
        if not isinstance(base, property):
            continue

        def fget(self: Any, base: property = base, name: str = name) -> Any:
            value = base.__get__(self, type(self))
            if not isinstance(value, (int, StepInt)) or isinstance(value, bool):
                return value
            label = f"{prefix}.{name}" if prefix else watch.label(self, name)
            return StepInt(_plain(value), label, watch)  # reading a StepInt's value is no use

        properties[name] = property(fget, doc=base.__doc__)
    return properties


@functools.cache
def _framework_names(cls: type) -> frozenset[str]:
    """Names the frameworks manage on ``cls``'s instances (see the module docstring)."""
    names = set(_instance_names(LightningModule if issubclass(cls, LightningModule) else nn.Module))
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] in _FRAMEWORK_PACKAGES:
            names |= {name for name in _code_names(klass) if name.startswith("_")}
    return frozenset(names)


@functools.cache
def _instance_names(base: type[nn.Module]) -> frozenset[str]:
    """What a bare ``nn.Module()`` or ``LightningModule()`` sets in ``__init__``."""
    return frozenset(vars(base()))


@functools.cache
def _code_names(klass: type) -> frozenset[str]:
    """Every name the code of ``klass``'s own functions (and properties) mentions."""
    names: set[str] = set()
    pending = []
    for value in vars(klass).values():
        if isinstance(value, property):
            pending += [function for function in (value.fget, value.fset, value.fdel) if function is not None]
        elif isinstance(value, (staticmethod, classmethod)):
            pending.append(value.__func__)
        elif isinstance(value, types.FunctionType):
            pending.append(value)
    codes = [function.__code__ for function in pending if hasattr(function, "__code__")]
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes += [constant for constant in code.co_consts if isinstance(constant, types.CodeType)]
    return frozenset(names)


def user_location() -> str:
    """``file:line`` of the innermost caller outside ``lightning_nnscaler.capture`` and torch."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith((_CAPTURE_DIRECTORY, _TORCH_DIRECTORY)):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    filename = frame.f_code.co_filename
    relative = os.path.relpath(filename) if os.path.isabs(filename) else filename
    return f"{relative if not relative.startswith('..') else filename}:{frame.f_lineno}"
