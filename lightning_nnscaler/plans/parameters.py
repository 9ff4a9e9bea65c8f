"""Typed recipe parameters: a recipe's config dataclass, and user input converted to it at the edge.

A built-in recipe takes ``(graph, ctx, config)``: its config is a frozen, keyword-only dataclass whose
fields are the recipe's parameters, each annotated ``int``, ``bool``, ``float``, ``str``,
``tuple[int, ...]`` or ``tuple[str, ...]`` (optionally ``| None``), documented by the docstring under
it, a count carrying ``metadata={"minimum": 1}``. A recipe registered with keyword-only parameters
(``register_recipe``) gets the same dataclass made from its signature (``signature_config``).

Input arrives as Python keyword arguments, Hydra values or command-line strings; ``ParameterSpec.convert``
turns each into the field's type or raises ``RecipeError`` naming the recipe, the key, the value and the
type expected. Scalars are taken as they are (Hydra has typed ``4`` already; the string ``"4"`` is refused
rather than guessed). A tuple field takes a list or tuple, a single entry, or a comma-separated string
(``layers_per_stage=3,3,2`` on a command line).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_nnscaler.ir.errors import NnScalerError

SCALAR_TYPES: dict[type, str] = {int: "int", bool: "bool", float: "float", str: "str"}
TUPLE_TYPES: dict[type, str] = {int: "tuple[int, ...]", str: "tuple[str, ...]"}
_ACCEPTED: dict[str, tuple[type, ...]] = {"int": (int,), "bool": (bool,), "float": (int, float), "str": (str,)}
_EXAMPLES = {"tuple[int, ...]": ("[3, 3, 2]", "'3,3,2'"), "tuple[str, ...]": ("['a', 'b']", "'a,b'")}


class RecipeError(NnScalerError, ValueError):
    """A recipe that is not in the catalog, a malformed recipe, or parameters that do not fit it."""


@dataclass(frozen=True)
class ParameterSpec:
    """One parameter of a recipe: a field of its config dataclass."""

    name: str
    """Keyword name."""
    type: str
    """``int``, ``bool``, ``float``, ``str``, ``tuple[int, ...]`` or ``tuple[str, ...]`` (the field's annotation)."""
    doc: str
    """What it controls."""
    required: bool = False
    """Whether a value must be given (no default)."""
    default: Any = None
    """Value when not given."""
    nullable: bool = False
    """Whether ``None`` is accepted (the annotation is ``T | None``, or the default is ``None``)."""
    minimum: int | float | None = None
    """The least value accepted (of each entry, for a tuple), e.g. 1 for a count; None: no bound."""

    @property
    def accepts_none(self) -> bool:
        """Whether ``None`` is a value of this parameter."""
        return self.nullable or (not self.required and self.default is None)

    def check(self, recipe: str, value: Any) -> None:
        """Raise RecipeError unless ``value`` converts to this parameter's type and is at least its ``minimum``."""
        self.convert(recipe, value)

    def convert(self, recipe: str, value: Any) -> Any:
        """``value`` as this parameter's type (a tuple field: a tuple), checked against the ``minimum``.

        Raises:
            RecipeError: naming the recipe, the key, the value and the type expected.
        """
        if value is None and self.accepts_none:
            return None
        if self.type in _EXAMPLES:
            entries = self._entries(recipe, value)
            for entry in entries:
                self._check_minimum(recipe, entry, value)
            return entries
        allowed = _ACCEPTED[self.type]
        if isinstance(value, bool) and bool not in allowed or not isinstance(value, allowed):
            raise RecipeError(f"recipe {recipe!r}: parameter {self.name!r} expects {self.type}, got {type(value).__name__} {value!r}")
        self._check_minimum(recipe, value)
        return float(value) if self.type == "float" else value

    def _entries(self, recipe: str, value: Any) -> tuple[Any, ...]:
        """A tuple field's value: a comma-separated string split, a single entry or a sequence, each entry of the entry type."""
        entry_type = int if self.type == "tuple[int, ...]" else str
        if isinstance(value, str):
            parts = [part.strip() for part in value.split(",") if part.strip()]
            try:
                return tuple(int(part) for part in parts) if entry_type is int else tuple(parts)
            except ValueError:
                pass
        elif entry_type is int and isinstance(value, int) and not isinstance(value, bool):
            return (value,)  # Hydra reads recompute_stages=0 as the int 0
        elif isinstance(value, Sequence):  # a list, a tuple, a Hydra ListConfig
            entries = tuple(value)
            if all(isinstance(entry, entry_type) and not isinstance(entry, bool) for entry in entries):
                return entries
        listed, comma = _EXAMPLES[self.type]
        raise RecipeError(
            f"recipe {recipe!r}: parameter {self.name!r} expects {self.type}: a list such as {listed} or a comma-separated "
            f"string such as {comma}, got {type(value).__name__} {value!r}"
        )

    def _check_minimum(self, recipe: str, value: Any, given: Any = None) -> None:
        """Raise unless ``value`` (an entry of ``given``, for a tuple field) is at least the minimum."""
        if self.minimum is None or value >= self.minimum:
            return
        none = ", or None for its default" if self.accepts_none else ""
        what = f"is {value!r}; it must be {self.type}" if given is None else f"has entry {value!r} in {given!r}; each entry must be int"
        raise RecipeError(
            f"recipe {recipe!r}: parameter {self.name!r} {what} >= {self.minimum}{none}" + (f" ({self.name}: {self.doc})" if self.doc else "")
        )


def parameter_specs(recipe: str, config: type, entries: dict[str, dict[str, Any]]) -> dict[str, ParameterSpec]:
    """The parameters of ``config``'s fields, in field order; ``entries`` (a catalog file's or ``register_recipe``'s
    ``{"doc": ..., "minimum": ...}`` per name) override a field's docstring and minimum.

    Raises:
        RecipeError: an entry naming no field, an annotation that is not one of the parameter types, a
            minimum on a parameter that is not a number, or a default the parameter itself refuses.
    """
    fields = {field.name: field for field in dataclasses.fields(config)}
    unknown = sorted(set(entries) - set(fields))
    if unknown:
        raise RecipeError(f"recipe {recipe!r}: documents parameter(s) {', '.join(unknown)} that {config.__qualname__} does not have")
    try:
        hints = typing.get_type_hints(config)
    except Exception as error:  # noqa: BLE001 - an unresolvable annotation is the author's to fix
        raise RecipeError(f"recipe {recipe!r}: cannot read the annotations of {config.__qualname__}: {error}") from error
    docs = field_docs(config)
    specs = {}
    for name, field in fields.items():
        type_name, nullable = type_of(recipe, name, hints.get(name))
        required = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        default = None if required else field.default if field.default is not dataclasses.MISSING else field.default_factory()
        minimum = entries.get(name, {}).get("minimum", field.metadata.get("minimum"))
        if minimum is not None and type_name not in ("int", "float", "tuple[int, ...]"):
            raise RecipeError(f"recipe {recipe!r}: parameter {name!r} is {type_name}, so it cannot have a minimum ({minimum!r})")
        doc = " ".join(str(entries.get(name, {}).get("doc") or docs.get(name, "")).split())
        spec = ParameterSpec(name, type_name, doc, required, default, nullable, minimum)
        if not required:
            spec.check(recipe, default)
        specs[name] = spec
    return specs


def type_of(recipe: str, key: str, hint: Any) -> tuple[str, bool]:
    """``(type name, accepts None)`` of an annotation such as ``int``, ``int | None`` or ``tuple[int, ...] | None``.

    Raises:
        RecipeError: naming the key when the annotation is none of the parameter types.
    """
    arguments = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    nullable = type(None) in arguments
    concrete = [argument for argument in arguments if argument is not type(None)]
    if len(concrete) == 1 and concrete[0] in SCALAR_TYPES:
        return SCALAR_TYPES[concrete[0]], nullable
    if len(concrete) == 1 and typing.get_origin(concrete[0]) is tuple:
        entry, *rest = typing.get_args(concrete[0]) or (None,)
        if rest == [Ellipsis] and entry in TUPLE_TYPES:
            return TUPLE_TYPES[entry], nullable
    raise RecipeError(
        f"recipe {recipe!r}: parameter {key!r} must be annotated int, bool, float or str, or tuple[int, ...] or "
        f"tuple[str, ...] (optionally '| None'), got {hint!r}"
    )


def field_docs(config: type) -> dict[str, str]:
    """Each field's docstring (the string literal under its annotation) in the source of ``config`` and of the
    dataclasses it derives from (the nearest wins); none for a class without source."""
    docs: dict[str, str] = {}
    for base in reversed(config.__mro__):
        if not dataclasses.is_dataclass(base):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(base)))
        except (OSError, TypeError, SyntaxError):
            continue
        docs.update(docs_under_fields(tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []))
    return docs


def docs_under_fields(body: list[ast.stmt]) -> dict[str, str]:
    """``{field: docstring}`` of a class body's annotated fields followed by a string literal."""
    docs = {}
    for statement, following in zip(body, body[1:]):
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name) and isinstance(following, ast.Expr):
            if isinstance(following.value, ast.Constant) and isinstance(following.value.value, str):
                docs[statement.target.id] = " ".join(following.value.value.split())
    return docs


def config_class(function: Callable[..., None]) -> type | None:
    """The config dataclass ``function(graph, ctx, config)`` takes (its third parameter's annotation); None when
    it takes keyword-only parameters instead."""
    positional = [parameter for parameter in inspect.signature(function).parameters.values()
                  if parameter.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 3:
        return None
    try:
        hint = typing.get_type_hints(function).get(positional[2].name)
    except Exception:  # noqa: BLE001 - reported below as a missing config
        hint = None
    if not (isinstance(hint, type) and dataclasses.is_dataclass(hint)):
        raise RecipeError(
            f"{function.__qualname__}: a recipe takes (graph, ctx, config: <a dataclass>) or (graph, ctx, *, <keyword-only "
            f"parameters>); its parameter {positional[2].name!r} is annotated {hint!r}"
        )
    return hint


def signature_config(recipe: str, function: Callable[..., None]) -> type:
    """A frozen keyword-only dataclass of ``function``'s keyword-only parameters (a recipe registered with them).

    Raises:
        RecipeError: naming the parameter whose annotation is not one of the parameter types.
    """
    try:
        hints = typing.get_type_hints(function)
    except Exception as error:  # noqa: BLE001 - an unresolvable annotation is the author's to fix
        raise RecipeError(f"recipe {recipe!r}: cannot read the annotations of {function.__qualname__}: {error}") from error
    fields = []
    for name, parameter in inspect.signature(function).parameters.items():
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY:
            type_of(recipe, name, hints.get(name))
            default = dataclasses.field() if parameter.default is inspect.Parameter.empty else dataclasses.field(default=parameter.default)
            fields.append((name, hints[name], default))
    return dataclasses.make_dataclass(f"{function.__name__}_config", fields, frozen=True, kw_only=True)


def fields_of(config: Any) -> dict[str, Any]:
    """A config's values by field name, in field order (shallow: tuples stay tuples)."""
    return {field.name: getattr(config, field.name) for field in dataclasses.fields(config)}
