"""The recipe catalog: every recipe by name, shared by Python, the strategy, Hydra and the CLI.

Built-in recipes are the files ``lightning_nnscaler/recipes/*.yaml`` (shipped in the wheel)::

    name: coshard
    function: lightning_nnscaler.plans.coshard:coshard
    layout: lightning_nnscaler.plans.coshard:coshard_layout
    summary: One or two lines on what the plan does.
    parameters:
      shards:
        doc: Pieces per device of each split.
        minimum: 1
    constraints:
      - What the model and world_size must satisfy.

A recipe's parameters are declared once, by its function's keyword-only parameters (name, type
annotation, default); the file documents them, each by its doc or by a mapping of ``doc`` and
``minimum`` (the least value accepted, checked with the type before anything runs: ``microbatches=0``
is refused naming the key, never read as "the default"). ``layout`` (optional) names the function
that says, before tracing, how many data-parallel replicas the plan has and into how many pieces it cuts
attention heads (``plans.layout``). A user's own recipe is registered from Python with
``register_recipe`` and is then usable everywhere a catalog name is. A recipe name is a name
(lower-case letters, digits, ``_``), never a path.
"""

from __future__ import annotations

import importlib
import inspect
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir.validate import validate_plan
from lightning_nnscaler.plans.context import PlanContext
from lightning_nnscaler.plans.layout import RecipeLayout, single_replica

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9_]*")
_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "bool": (bool,), "float": (int, float), "str": (str,)}
_REQUIRED_KEYS = ("name", "function", "summary")
PlanFunction = Callable[..., None]
LayoutFunction = Callable[[int, dict[str, Any]], RecipeLayout]


class RecipeError(ValueError):
    """A recipe that is not in the catalog, a malformed recipe, or parameters that do not fit it."""


@dataclass(frozen=True)
class ParameterSpec:
    """One keyword parameter of a recipe function."""

    name: str
    """Keyword name."""
    type: str
    """One of ``int``, ``bool``, ``float``, ``str`` (from the function's annotation)."""
    doc: str
    """What it controls."""
    required: bool = False
    """Whether a value must be given (no default)."""
    default: Any = None
    """Value when not given."""
    nullable: bool = False
    """Whether ``None`` is accepted (the annotation is ``T | None``, or the default is ``None``)."""
    minimum: int | float | None = None
    """The least value accepted (an int or float parameter), e.g. 1 for a count; None: no bound."""

    def check(self, recipe: str, value: Any) -> None:
        """Raise RecipeError unless ``value`` is of this parameter's type and at least its ``minimum``."""
        if value is None and (self.nullable or (not self.required and self.default is None)):
            return
        allowed = _TYPES[self.type]
        if isinstance(value, bool) and bool not in allowed or not isinstance(value, allowed):
            raise RecipeError(
                f"recipe {recipe!r}: parameter {self.name!r} expects {self.type}, got {type(value).__name__} {value!r}"
            )
        if self.minimum is not None and not value >= self.minimum:
            none = ", or None for its default" if self.nullable or (not self.required and self.default is None) else ""
            raise RecipeError(
                f"recipe {recipe!r}: parameter {self.name!r} is {value!r}; it must be {self.type} >= {self.minimum}{none}"
                + (f" ({self.name}: {self.doc})" if self.doc else "")
            )


@dataclass(frozen=True)
class RecipeSpec:
    """A recipe: its plan function, parameters, promised layout and documentation."""

    name: str
    """Catalog name."""
    function: PlanFunction
    """``function(graph, ctx, **params)`` plans ``graph`` in place with the primitives."""
    summary: str
    """What the plan does, in a line or two."""
    parameters: dict[str, ParameterSpec]
    """Keyword parameters by name, in signature order."""
    constraints: tuple[str, ...] = ()
    """What the model and world_size must satisfy for the plan to split what it means to."""
    layout_function: LayoutFunction = single_replica
    """``layout_function(world_size, params)``: the device grid and head pieces, before tracing."""
    origin: str = "register_recipe"
    """The catalog file, or where ``register_recipe`` was called from."""

    def load_function(self) -> PlanFunction:
        """The plan function."""
        return self.function

    def check_parameters(self, params: dict[str, Any]) -> None:
        """Raise RecipeError naming the recipe and the key for an unknown, missing or mistyped parameter."""
        expected = ", ".join(f"{spec.name} ({spec.type})" for spec in self.parameters.values()) or "none"
        for key, value in params.items():
            if key not in self.parameters:
                raise RecipeError(f"recipe {self.name!r}: unknown parameter {key!r}; its parameters are: {expected}")
            self.parameters[key].check(self.name, value)
        for spec in self.parameters.values():
            if spec.required and spec.name not in params:
                raise RecipeError(f"recipe {self.name!r}: parameter {spec.name!r} ({spec.type}) is required")

    def with_defaults(self, params: dict[str, Any]) -> dict[str, Any]:
        """``params`` completed with the defaults of the parameters not given."""
        return {**{key: spec.default for key, spec in self.parameters.items() if not spec.required}, **params}

    def layout(self, world_size: int, params: dict[str, Any]) -> RecipeLayout:
        """What the recipe promises for ``world_size`` ranks with ``params`` (checked first).

        Raises:
            RecipeError: bad parameters, or a layout whose grid is not ``world_size`` ranks.
            ValueError: the parameters do not fit ``world_size`` (the layout function's own check).
        """
        self.check_parameters(params)
        layout = self.layout_function(world_size, self.with_defaults(params))
        if layout.grid.size != world_size:
            raise RecipeError(
                f"recipe {self.name!r}: its layout {layout.grid} has {layout.grid.size} ranks, not world_size={world_size}"
            )
        return layout


_REGISTRY: dict[str, RecipeSpec] = {}
_BUILT_INS_READ = False
_LISTENERS: list[Callable[[RecipeSpec], None]] = []


def register_recipe(
    function: PlanFunction | None = None, *, name: str | None = None, summary: str | None = None,
    parameter_docs: dict[str, str] | None = None, constraints: tuple[str, ...] | list[str] = (),
    layout: LayoutFunction | None = None, replace: bool = False, parameter_minimums: dict[str, float] | None = None,
) -> Any:
    """Add a recipe to the catalog; usable as ``@register_recipe`` or ``@register_recipe(name=...)``.

    Afterwards the name works wherever a catalog name does: ``parallelize(..., recipe=name)``,
    ``NnScalerStrategy(recipe=name)``, ``Trainer(strategy="nnscaler_<name>")``, the CLI
    (``lightning-nnscaler --import your.module recipes``) and a Hydra ``recipe.name``.

    Args:
        function: ``function(graph, ctx, *, <keyword-only parameters>) -> None``, planning ``graph``
            in place with ``op_trans`` / ``op_assign`` / ``op_order``. Its keyword-only parameters
            (annotated ``int``, ``bool``, ``float``, ``str``, optionally ``| None``) are the
            recipe's parameters.
        name: Catalog name (default: the function's name): lower-case letters, digits and ``_``.
        summary: One line on what the plan does (default: the docstring's first line).
        parameter_docs: What each parameter controls.
        constraints: What the model and world size must satisfy.
        layout: ``layout(world_size, params) -> RecipeLayout`` — data-parallel replicas and head
            pieces, known before tracing. Default: one replica (every rank loads the same samples;
            always correct).
        replace: Allow replacing a recipe registered earlier under ``name`` (not a built-in).
        parameter_minimums: The least value each int or float parameter accepts (e.g. ``{"stages": 1}``);
            a smaller one is refused, naming the parameter, before the recipe runs.

    Raises:
        RecipeError: a bad name, a name taken, or a function whose parameters cannot be checked.
    """

    def register(plan_function: PlanFunction) -> PlanFunction:
        recipe_name = name or plan_function.__name__
        _check_name(recipe_name)
        _read_built_ins()
        taken = _REGISTRY.get(recipe_name)
        if taken is not None and (not replace or taken.origin != "register_recipe"):
            raise RecipeError(
                f"register_recipe: the name {recipe_name!r} is taken by {taken.origin}; pick another name"
                + ("" if taken.origin != "register_recipe" else " or pass replace=True")
            )
        doc_line = (inspect.getdoc(plan_function) or "").strip().splitlines()
        spec = RecipeSpec(
            recipe_name, plan_function, summary or (doc_line[0] if doc_line else recipe_name),
            _parameters(recipe_name, plan_function, _entries(parameter_docs or {}, parameter_minimums or {}), require_docs=False),
            tuple(constraints), layout or single_replica, "register_recipe",
        )
        _add(spec)
        return plan_function

    return register if function is None else register(function)


def on_register(listener: Callable[[RecipeSpec], None]) -> None:
    """Call ``listener(spec)`` for every recipe in the catalog now and every recipe registered later."""
    _LISTENERS.append(listener)
    for spec in list_recipes():
        listener(spec)


def list_recipes(directory: Path | None = None) -> list[RecipeSpec]:
    """Every recipe of the catalog (or of the recipe files in ``directory``), sorted by name."""
    if directory is not None:
        return [_read(path) for path in sorted(Path(directory).glob("*.yaml"))]
    _read_built_ins()
    return [_REGISTRY[name] for name in sorted(_REGISTRY)]


def load_recipe(name: str, directory: Path | None = None) -> RecipeSpec:
    """The recipe called ``name`` (from the catalog, or from the files in ``directory``).

    Raises:
        RecipeError: a name that is not a name (a path, for instance), or listing the catalog's
            recipes when there is none by that name.
    """
    _check_name(name)
    if directory is not None:
        path = Path(directory) / f"{name}.yaml"
        if not path.is_file():
            raise RecipeError(f"unknown recipe {name!r}; {directory} has: {', '.join(sorted(p.stem for p in Path(directory).glob('*.yaml')))}")
        return _read(path)
    _read_built_ins()
    if name not in _REGISTRY:
        raise RecipeError(
            f"unknown recipe {name!r}; the catalog has: {', '.join(sorted(_REGISTRY))}. "
            "Register your own with lightning_nnscaler.register_recipe."
        )
    return _REGISTRY[name]


def apply_recipe(graph: Graph, name: str, world_size: int, **params: Any) -> PlanContext:
    """Plan ``graph`` in place with recipe ``name`` over ``world_size`` devices, then validate the plan.

    The parameters are checked before the graph is touched, and the recipe runs on a copy: when it
    raises, ``graph`` is left as it was.

    Returns:
        The context: the recipe's layout and the runtime options the recipe set (e.g. ``zero_stage``).

    Raises:
        RecipeError: unknown recipe, or a parameter that is unknown, missing or of the wrong type.
        ValueError: the recipe's own checks (e.g. ``hybrid``'s ``dp × tp``).
        PlanError: the plan does not validate (``validate_plan``).
    """
    spec = load_recipe(name)
    layout = spec.layout(world_size, params)
    ctx = PlanContext(world_size=world_size, layout=layout)
    plan = graph.copy()
    spec.function(plan, ctx, **params)
    validate_plan(plan, world_size)
    graph.take_contents(plan)
    return ctx


def keyword_parameters(function: Callable[..., None]) -> dict[str, inspect.Parameter]:
    """The keyword-only parameters of a plan function (the recipe's parameters)."""
    return {
        name: parameter
        for name, parameter in inspect.signature(function).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    }


def _check_name(name: Any) -> None:
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise RecipeError(
            f"recipe {name!r} is not a recipe name: a name is lower-case letters, digits and '_' (e.g. 'tp'), "
            "never a path or a module. Register your own recipe with lightning_nnscaler.register_recipe and pass its name."
        )


def _add(spec: RecipeSpec) -> None:
    _REGISTRY[spec.name] = spec
    for listener in _LISTENERS:
        listener(spec)


def _read_built_ins() -> None:
    global _BUILT_INS_READ
    if _BUILT_INS_READ:
        return
    _BUILT_INS_READ = True
    for path in sorted(RECIPES_DIR.glob("*.yaml")):
        _REGISTRY.setdefault(path.stem, _read(path))


def _entries(docs: dict[str, str], minimums: dict[str, float]) -> dict[str, dict[str, Any]]:
    """``register_recipe``'s docs and minimums as the catalog file's parameter entries (``{"doc": ..., "minimum": ...}``)."""
    return {key: {"doc": docs.get(key, ""), **({"minimum": minimums[key]} if key in minimums else {})} for key in {**docs, **minimums}}


def _parameters(recipe: str, function: PlanFunction, entries: dict[str, dict[str, Any]], *, require_docs: bool) -> dict[str, ParameterSpec]:
    """The recipe's parameters from ``function``'s keyword-only parameters, documented by ``entries``
    (each a ``doc`` and, optionally, the ``minimum`` value accepted)."""
    keywords = keyword_parameters(function)
    docs = {key: entry.get("doc") for key, entry in entries.items()}
    unknown = sorted(set(docs) - set(keywords))
    if unknown:
        raise RecipeError(f"recipe {recipe!r}: documents parameter(s) {', '.join(unknown)} that {function.__qualname__} does not take")
    try:
        hints = typing.get_type_hints(function)
    except Exception as error:  # noqa: BLE001 - an unresolvable annotation is the author's to fix
        raise RecipeError(f"recipe {recipe!r}: cannot read the annotations of {function.__qualname__}: {error}") from error
    specs = {}
    for key, parameter in keywords.items():
        if require_docs and not docs.get(key):
            raise RecipeError(f"recipe {recipe!r}: parameter {key!r} of {function.__qualname__} has no doc in the catalog file")
        type_name, nullable = _type_of(recipe, key, hints.get(key))
        required = parameter.default is inspect.Parameter.empty
        minimum = entries.get(key, {}).get("minimum")
        if minimum is not None and type_name not in ("int", "float"):
            raise RecipeError(f"recipe {recipe!r}: parameter {key!r} is {type_name}, so it cannot have a minimum ({minimum!r})")
        spec = ParameterSpec(
            key, type_name, " ".join(str(docs.get(key) or "").split()), required, None if required else parameter.default, nullable, minimum,
        )
        if not required:
            spec.check(recipe, spec.default)
        specs[key] = spec
    return specs


def _type_of(recipe: str, key: str, hint: Any) -> tuple[str, bool]:
    """``(type name, accepts None)`` of an annotation such as ``int`` or ``int | None``."""
    arguments = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    nullable = type(None) in arguments
    concrete = [argument for argument in arguments if argument is not type(None)]
    names = {int: "int", bool: "bool", float: "float", str: "str"}
    if len(concrete) != 1 or concrete[0] not in names:
        raise RecipeError(
            f"recipe {recipe!r}: parameter {key!r} must be annotated int, bool, float or str (optionally '| None'), got {hint!r}"
        )
    return names[concrete[0]], nullable


def _import(path: Path, reference: Any, key: str) -> Any:
    module_name, _, attribute = str(reference).partition(":")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError) as error:
        raise RecipeError(f"recipe file {path}: cannot import {key} {reference!r}: {error}") from error


def _file_entries(path: Path, parameters: Any) -> dict[str, dict[str, Any]]:
    """A catalog file's ``parameters``: each name maps to its doc, or to ``{doc: ..., minimum: <number>}``."""
    expected = "'parameters' maps each parameter name to its doc (a string), or to a mapping of 'doc' (a string) and 'minimum' (a number)"
    if not isinstance(parameters, dict):
        raise RecipeError(f"recipe file {path}: {expected}")
    entries = {key: {"doc": entry} if isinstance(entry, str) else entry for key, entry in parameters.items()}
    for key, entry in entries.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("doc"), str) or set(entry) - {"doc", "minimum"} or (
            type(entry.get("minimum", 0)) not in (int, float)
        ):
            raise RecipeError(f"recipe file {path}: {expected}, e.g. 'minimum: 1'; parameter {key!r} has {entry!r}")
    return entries


def _read(path: Path) -> RecipeSpec:
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise RecipeError(f"recipe file {path}: expected a mapping with keys {', '.join(_REQUIRED_KEYS)}")
    missing = [key for key in _REQUIRED_KEYS if key not in data]
    if missing:
        raise RecipeError(f"recipe file {path}: missing key(s) {', '.join(missing)}")
    if data["name"] != path.stem:
        raise RecipeError(f"recipe file {path}: name {data['name']!r} must be the file's stem {path.stem!r}")
    _check_name(data["name"])
    entries = _file_entries(path, data.get("parameters") or {})
    function = _import(path, data["function"], "function")
    layout = _import(path, data["layout"], "layout") if data.get("layout") else single_replica
    summary = " ".join(str(data["summary"]).split())
    parameters = _parameters(data["name"], function, entries, require_docs=True)
    return RecipeSpec(data["name"], function, summary, parameters, tuple(data.get("constraints") or ()), layout, str(path))
