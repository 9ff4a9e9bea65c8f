"""The recipe catalog: every recipe by name, shared by Python, the strategy, Hydra and the CLI.

Built-in recipes are the files ``lightning_nnscaler/recipes/*.yaml`` (shipped in the wheel)::

    name: coshard
    function: lightning_nnscaler.plans.coshard:coshard
    layout: lightning_nnscaler.plans.coshard:coshard_layout
    summary: One or two lines on what the plan does.
    constraints:
      - What the model and world_size must satisfy.

A recipe's parameters are declared once, by the config dataclass its function takes
(``coshard(graph, ctx, config: CoshardConfig)``): each field's name, annotation, default, docstring
and ``minimum`` (the least value accepted, checked with the type before anything runs:
``microbatches=0`` is refused naming the key, never read as "the default"); see ``plans.parameters``.
A file may still document a parameter (``parameters: {shards: {doc: ..., minimum: 1}}``), overriding
the field's docstring and minimum; it may name no parameter the config lacks. ``layout`` (optional)
names the function that says, before tracing, how many data-parallel replicas the plan has and into
how many pieces it cuts attention heads (``plans.layout``). A user's own recipe is registered from
Python with ``register_recipe`` (keyword-only parameters, or a config) and is then usable everywhere
a catalog name is. A recipe name is a name (lower-case letters, digits, ``_``), never a path.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir.validate import validate_plan
from lightning_nnscaler.plans.context import PlanContext
from lightning_nnscaler.plans.layout import RecipeLayout, single_replica
from lightning_nnscaler.plans.parameters import ParameterSpec, RecipeError, config_class, fields_of, parameter_specs, signature_config
from lightning_nnscaler.plans.stage_cuts import OpPrices

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9_]*")
_REQUIRED_KEYS = ("name", "function", "summary")
PlanFunction = Callable[..., None]
LayoutFunction = Callable[[int, dict[str, Any]], RecipeLayout]

__all__ = ["ParameterSpec", "RecipeError", "RecipeSpec", "apply_recipe", "list_recipes", "load_recipe", "on_register", "register_recipe"]


@dataclass(frozen=True)
class RecipeSpec:
    """A recipe: its plan function, config dataclass, parameters, promised layout and documentation."""

    name: str
    """Catalog name."""
    function: PlanFunction
    """``function(graph, ctx, config)`` (or ``function(graph, ctx, **fields)``) plans ``graph`` in place with the primitives."""
    summary: str
    """What the plan does, in a line or two."""
    config: type
    """The frozen keyword-only dataclass of the recipe's parameters (``plans.parameters``)."""
    parameters: dict[str, ParameterSpec]
    """The config's fields by name, in field order."""
    constraints: tuple[str, ...] = ()
    """What the model and world_size must satisfy for the plan to split what it means to."""
    layout_function: LayoutFunction = single_replica
    """``layout_function(world_size, params)``: the device grid and head pieces, before tracing."""
    origin: str = "register_recipe"
    """The catalog file, or where ``register_recipe`` was called from."""
    takes_config: bool = True
    """Whether ``function`` takes the config itself (else each field as a keyword argument)."""

    def load_function(self) -> PlanFunction:
        """The plan function."""
        return self.function

    def build_config(self, params: dict[str, Any]) -> Any:
        """``params`` (Python values, Hydra values or command-line strings) as the recipe's config.

        Raises:
            RecipeError: naming the recipe and the key for an unknown, missing or mistyped parameter.
        """
        expected = ", ".join(f"{spec.name} ({spec.type})" for spec in self.parameters.values()) or "none"
        for key in params:
            if key not in self.parameters:
                raise RecipeError(f"recipe {self.name!r}: unknown parameter {key!r}; its parameters are: {expected}")
        for spec in self.parameters.values():
            if spec.required and spec.name not in params:
                raise RecipeError(f"recipe {self.name!r}: parameter {spec.name!r} ({spec.type}) is required")
        return self.config(**{key: self.parameters[key].convert(self.name, value) for key, value in params.items()})

    def check_parameters(self, params: dict[str, Any]) -> None:
        """Raise RecipeError naming the recipe and the key for an unknown, missing or mistyped parameter."""
        self.build_config(params)

    def with_defaults(self, params: dict[str, Any]) -> dict[str, Any]:
        """``params`` converted and completed with the defaults of the parameters not given."""
        return fields_of(self.build_config(params))

    def layout(self, world_size: int, params: dict[str, Any]) -> RecipeLayout:
        """What the recipe promises for ``world_size`` ranks with ``params`` (checked first).

        Raises:
            RecipeError: bad parameters, or a layout whose grid is not ``world_size`` ranks.
            ValueError: the parameters do not fit ``world_size`` (the layout function's own check).
        """
        layout = self.layout_function(world_size, self.with_defaults(params))
        if layout.grid.size != world_size:
            raise RecipeError(
                f"recipe {self.name!r}: its layout {layout.grid} has {layout.grid.size} ranks, not world_size={world_size}"
            )
        return layout

    def run(self, graph: Graph, ctx: PlanContext, config: Any) -> None:
        """Plan ``graph`` in place with ``config`` (``build_config``)."""
        if self.takes_config:
            self.function(graph, ctx, config)
        else:
            self.function(graph, ctx, **fields_of(config))


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
        function: ``function(graph, ctx, *, <keyword-only parameters>) -> None``, or
            ``function(graph, ctx, config: <a frozen keyword-only dataclass>) -> None``, planning ``graph``
            in place with ``op_trans`` / ``op_assign`` / ``op_order``. The keyword-only parameters, or the
            dataclass's fields (annotated ``int``, ``bool``, ``float``, ``str``, ``tuple[int, ...]`` or
            ``tuple[str, ...]``, optionally ``| None``), are the recipe's parameters (``plans.parameters``).
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
        spec = _spec(
            recipe_name, plan_function, summary or (doc_line[0] if doc_line else recipe_name),
            _entries(parameter_docs or {}, parameter_minimums or {}), tuple(constraints), layout or single_replica, "register_recipe",
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


def apply_recipe(graph: Graph, name: str, world_size: int, *, measured_prices: OpPrices | None = None, **params: Any) -> PlanContext:
    """Plan ``graph`` in place with recipe ``name`` over ``world_size`` devices, then validate the plan.

    ``measured_prices``: each op's measured seconds, for a pipeline recipe's ``balance="measured"`` (``PlanContext``).

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
    config = spec.build_config(params)  # user input becomes the typed config here, and only here
    layout = spec.layout(world_size, params)
    ctx = PlanContext(world_size=world_size, layout=layout, measured_prices=measured_prices)
    plan = graph.copy()
    spec.run(plan, ctx, config)
    validate_plan(plan, world_size)
    graph.take_contents(plan)
    return ctx


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


def _spec(
    name: str, function: PlanFunction, summary: str, entries: dict[str, dict[str, Any]], constraints: tuple[str, ...],
    layout: LayoutFunction, origin: str,
) -> RecipeSpec:
    """A recipe's spec: its config is the dataclass ``function`` takes, or one made from its keyword-only parameters."""
    config = config_class(function)
    takes_config = config is not None
    if config is None:
        config = signature_config(name, function)
    parameters = parameter_specs(name, config, entries)
    return RecipeSpec(name, function, summary, config, parameters, constraints, layout, origin, takes_config)


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
    spec = _spec(data["name"], function, summary, entries, tuple(data.get("constraints") or ()), layout, str(path))
    undocumented = [key for key, parameter in spec.parameters.items() if not parameter.doc]
    if undocumented:
        raise RecipeError(
            f"recipe file {path}: parameter(s) {', '.join(undocumented)} of {spec.config.__qualname__} have no doc: "
            "give each field a docstring (or the file a doc for it)"
        )
    return spec
