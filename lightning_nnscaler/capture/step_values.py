"""Python values that a captured ``training_step`` would freeze: followed (lifted or guarded), refused, or checked every step.

``NnScalerStrategy`` traces ``training_step`` once, on the first batch, and then runs the captured
tensor computation on every batch. The step's Python runs only at that trace, so whatever it
computes from a value that changes between steps keeps the first step's result: ``if batch_idx % 2``,
``if self.global_step > 3``, ``loss * self.current_epoch``, ``if self.calls > 0``. This module turns
each of these into either the right value at every step or a `FrozenValueError`, never silently
wrong training.

**Per-step values** are followed, not frozen. While the step is traced, ``batch_idx``,
``self.global_step`` and ``self.current_epoch`` (on every LightningModule of the tree), and
``self.trainer.global_step`` / ``self.trainer.current_epoch`` (when a Trainer is attached; without
one the module's properties are 0, as Lightning defines them) are symbolic `StepInt`s
(``capture.step_symbols``): arithmetic on them (the number on either side) is lifted into the graph
where it meets a tensor, and every decision on them (a branch, a comparison, ``int()``, an index, a
dict key, a size passed to torch) is a `Guard` of the plan, which the strategy checks before every
step (planning again for a new outcome). Formatting (``str``, ``repr``, f-strings) is neither: a
name such as ``f"loss_{batch_idx}"`` cannot change the loss.

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
import os
import sys
import types
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, Iterator

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from lightning_nnscaler.capture.convert import CaptureError
from lightning_nnscaler.capture.step_symbols import Expression, Guard, StepInt, quantity_of

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
    """What the traced ``training_step`` took from outside its tensors: the plain attributes it read (with
    their values at tracing), the decisions it made on per-step values (`Guard`s) and the graph constants
    that carry the per-step quantities its lifted arithmetic uses."""

    attributes: tuple[FrozenAttribute, ...] = ()
    guards: tuple[Guard, ...] = ()
    lifted: tuple[tuple[str, str], ...] = ()
    """``(graph constant name, step quantity)`` for each quantity the graph computes with."""

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

    def failed_guard(self, values: Mapping[str, int]) -> Guard | None:
        """The first decision the step would make otherwise at step quantities ``values`` (None: the plan holds)."""
        return next((guard for guard in self.guards if not guard.holds(values)), None)

    def constants(self, values: Mapping[str, int]) -> dict[str, int]:
        """The lifted constants' values at step quantities ``values``, by graph constant name."""
        return {name: values[quantity] for name, quantity in self.lifted}


def _same(current: Any, traced: Any) -> bool:
    """Equal and of the same type (``1``, ``1.0`` and ``True`` differ; NaN equals NaN)."""
    if type(current) is not type(traced):
        return False
    return current == traced or (isinstance(traced, float) and math.isnan(traced) and math.isnan(current))


class StepWatch:
    """What one trace of ``training_step`` used: per-step values, and plain attributes read or assigned."""

    def __init__(self, module: nn.Module, values: Mapping[str, int]) -> None:
        self.module = module
        self.values = dict(values)
        self.batch_idx = self.step_int("batch_idx")
        self.leaves = {quantity: torch.tensor(value, dtype=torch.int64) for quantity, value in self.values.items()}
        self.guards: list[Guard] = []
        self.lifted: set[str] = set()
        self.writes: dict[str, str] = {}  # label -> where it was first assigned
        self._reads: dict[tuple[int, str], FrozenAttribute] = {}
        self._overwritten: dict[tuple[int, str], tuple[nn.Module, str, Any]] = {}  # the value before the first write
        self._paths = {id(sub): path for path, sub in module.named_modules()}

    def step_int(self, label: str) -> StepInt:
        """The per-step value ``label`` (``batch_idx``, ``self.trainer.global_step``) at this trace."""
        return StepInt(self.values[quantity_of(label)], Expression("leaf", (), label), self)

    def guard(self, expression: Expression, outcome: Any) -> None:
        """The step decided ``outcome`` from ``expression`` (called by `StepInt`)."""
        self.guards.append(Guard(expression, outcome, user_location()))

    def lift(self, value: StepInt, beside: torch.Tensor | None = None) -> torch.Tensor:
        """``value`` as a 0-d tensor the graph computes from the quantities' constants (called by `StepInt`).

        Beside a tensor it takes the dtype a Python number takes there (as ``torch.result_type``, which
        cannot run inside the trace: a float beside float32 is float32), so that ``loss * factor``
        computes as with the number itself.
        """
        self.lifted |= {quantity_of(label) for label in value._expression.labels()}
        lifted = value._expression.tensor(self.leaves, self.values)
        if beside is None:
            return lifted
        dtype = _number_dtype_beside(beside.dtype, value._value)
        return lifted if lifted.dtype == dtype else lifted.to(dtype)

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
        """Per-step values passed to torch functions: lifted into the graph, or guards (``_StepIntArguments``)."""
        with _StepIntArguments():
            yield

    def step_values(self, constant_values: Mapping[str, torch.Tensor]) -> StepValues:
        """The attributes read (in the order of their first read), the guards, and which of the graph's
        ``constant_values`` are the lifted quantities' leaves."""
        leaf_quantity = {id(tensor): quantity for quantity, tensor in self.leaves.items() if quantity in self.lifted}
        lifted = tuple((name, leaf_quantity[id(tensor)]) for name, tensor in constant_values.items() if id(tensor) in leaf_quantity)
        return StepValues(tuple(self._reads.values()), tuple(self.guards), lifted)

    def raise_if_frozen(self, cause: BaseException | None = None) -> None:
        """Raise if the step assigned a plain attribute.

        Raises:
            FrozenValueError: naming every value, where it was used, and the fix.
        """
        problems = []
        if self.writes:
            written = ", ".join(f"{label} (at {location})" for label, location in self.writes.items())
            problems.append(
                f"assigns {written}: the step's Python runs once, at the trace, so the assignment would not happen on later "
                "steps. Move it to a hook such as on_train_batch_start or on_train_batch_end, which runs every step."
            )
        if problems:
            raise FrozenValueError(f"{type(self.module).__name__}.training_step " + "\nIt also ".join(problems)) from cause


def _number_dtype_beside(dtype: torch.dtype, number: int | float) -> torch.dtype:
    """The dtype torch's promotion gives a Python ``number`` in an op with a tensor of ``dtype``."""
    if isinstance(number, float):
        return dtype if dtype.is_floating_point or dtype.is_complex else torch.get_default_dtype()
    return torch.int64 if dtype == torch.bool and not isinstance(number, bool) else dtype


class _StepIntArguments(TorchFunctionMode):
    """Sees every torch call (torch reads ints in C, past StepInt's methods): a `StepInt` operand of an
    elementwise op (``loss * step``) or the data of ``torch.tensor(step)`` is lifted into the graph; any
    other (a size, a dim) is its traced value, kept as a guard."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor, torch.scalar_tensor) and args and isinstance(args[0], StepInt):
            lifted = args[0]._watch.lift(args[0])
            dtype = kwargs.get("dtype") or (torch.get_default_dtype() if lifted.dtype == torch.float64 and func is not torch.scalar_tensor else lifted.dtype)
            return lifted.to(dtype=dtype, device=kwargs.get("device"))
        liftable = getattr(func, "__name__", "").strip("_").removeprefix("r") in _ELEMENTWISE
        beside = next((leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)), None)

        def replace(leaf: Any) -> Any:
            if not isinstance(leaf, StepInt):
                return leaf
            if liftable:
                return leaf._watch.lift(leaf, beside)
            return leaf.decide("float" if isinstance(leaf._value, float) else "int")

        args, kwargs = pytree.tree_map(replace, (args, kwargs))
        return func(*args, **kwargs)


# Tensor methods and torch functions whose number operands are lifted (``Tensor.__rmul__``, ``torch.where``, ...).
_ELEMENTWISE = frozenset("""add sub mul div truediv true_divide floordiv floor_divide mod remainder fmod pow where clamp clip
minimum maximum lerp eq ne lt le gt ge and or xor""".split())


@contextlib.contextmanager
def watch_step(module: nn.Module, batch_idx: int = 0) -> Iterator[StepWatch]:
    """While tracing ``module.training_step`` at ``batch_idx``: every module of the tree (and its Trainer) runs
    as a subclass that reports to the yielded `StepWatch`; the original classes are back on exit, also on error."""
    watch = StepWatch(module, step_quantities(module, batch_idx))
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


def step_quantities(module: nn.Module, batch_idx: int) -> dict[str, int]:
    """The step quantities where ``module`` is now: ``batch_idx``, and its Trainer's step and epoch (0 without one)."""
    trainer = vars(module).get("_trainer")
    if not isinstance(trainer, Trainer):
        return {"batch_idx": batch_idx, "global_step": 0, "current_epoch": 0}
    return {"batch_idx": batch_idx, "global_step": trainer.global_step, "current_epoch": trainer.current_epoch}


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
            return watch.step_int(f"{prefix}.{name}" if prefix else watch.label(self, name))

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
