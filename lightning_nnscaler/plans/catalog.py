"""The recipe catalog: ``recipes/*.yaml``, one file per recipe, shared by Python, Hydra and the CLI.

Each file names the plan function and documents its keyword parameters::

    name: coshard
    function: lightning_nnscaler.plans.coshard:coshard
    summary: One or two lines on what the plan does.
    parameters:
      shards: {type: int, default: 4, doc: Pieces per device of each split.}
      dp: {type: int, required: true, doc: ...}
    constraints:
      - What the model and world_size must satisfy for the plan to split what it means to.

``apply_recipe`` checks the parameters against the file before it touches the graph.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir.validate import validate_plan
from lightning_nnscaler.plans.context import PlanContext

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "bool": (bool,), "float": (int, float), "str": (str,)}
_REQUIRED_KEYS = ("name", "function", "summary")


class RecipeError(ValueError):
    """A recipe that is not in the catalog, a malformed recipe file, or parameters that do not fit it."""


@dataclass(frozen=True)
class ParameterSpec:
    """One keyword parameter of a recipe function."""

    name: str
    """Keyword name."""
    type: str
    """One of ``int``, ``bool``, ``float``, ``str``."""
    doc: str
    """What it controls."""
    required: bool = False
    """Whether a value must be given (no default)."""
    default: Any = None
    """Value when not given (``None`` may also be passed explicitly when this is ``None``)."""

    def check(self, recipe: str, value: Any) -> None:
        """Raise RecipeError unless ``value`` is of this parameter's type."""
        if value is None and not self.required and self.default is None:
            return
        allowed = _TYPES[self.type]
        if isinstance(value, bool) and bool not in allowed or not isinstance(value, allowed):
            raise RecipeError(
                f"recipe {recipe!r}: parameter {self.name!r} expects {self.type}, got {type(value).__name__} {value!r}"
            )


@dataclass(frozen=True)
class RecipeSpec:
    """A recipe as its catalog file describes it."""

    name: str
    """Catalog name (the file's stem)."""
    function: str
    """``"module.path:function"`` of the plan function."""
    summary: str
    """What the plan does, in a line or two."""
    parameters: dict[str, ParameterSpec]
    """Keyword parameters by name, in file order."""
    constraints: tuple[str, ...] = ()
    """What the model and world_size must satisfy for the plan to split what it means to."""

    def load_function(self) -> Callable[..., None]:
        """Import the plan function."""
        module_name, _, attribute = self.function.partition(":")
        try:
            return getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as error:
            raise RecipeError(f"recipe {self.name!r}: cannot import function {self.function!r}: {error}") from error

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


def list_recipes(directory: Path = RECIPES_DIR) -> list[RecipeSpec]:
    """Every recipe of the catalog, sorted by name."""
    return [_read(path) for path in sorted(directory.glob("*.yaml"))]


def load_recipe(name: str, directory: Path = RECIPES_DIR) -> RecipeSpec:
    """The recipe called ``name``.

    Raises:
        RecipeError: listing the catalog's recipes when there is none by that name.
    """
    path = directory / f"{name}.yaml"
    if not isinstance(name, str) or not path.is_file():
        known = ", ".join(sorted(path.stem for path in directory.glob("*.yaml")))
        raise RecipeError(f"unknown recipe {name!r}; the catalog ({directory}) has: {known}")
    return _read(path)


def apply_recipe(graph: Graph, name: str, world_size: int, **params: Any) -> PlanContext:
    """Plan ``graph`` in place with recipe ``name`` over ``world_size`` devices, then validate the plan.

    The parameters are checked against the catalog before the graph is touched, and the recipe runs
    on a copy: when it raises, ``graph`` is left as it was.

    Returns:
        The context, with the runtime options the recipe set (e.g. ``zero_stage``).

    Raises:
        RecipeError: unknown recipe, or a parameter that is unknown, missing or of the wrong type.
        ValueError: the recipe's own checks (e.g. ``hybrid``'s ``dp × tp``).
        PlanError: the plan does not validate (``validate_plan``).
    """
    spec = load_recipe(name)
    spec.check_parameters(params)
    ctx = PlanContext(world_size=world_size)
    plan = graph.copy()
    spec.load_function()(plan, ctx, **params)
    validate_plan(plan, world_size)
    graph.take_contents(plan)
    return ctx


def keyword_parameters(function: Callable[..., None]) -> dict[str, inspect.Parameter]:
    """The keyword-only parameters of a plan function (what its catalog file must document)."""
    return {
        name: parameter
        for name, parameter in inspect.signature(function).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    }


def _read(path: Path) -> RecipeSpec:
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise RecipeError(f"recipe file {path}: expected a mapping with keys {', '.join(_REQUIRED_KEYS)}")
    missing = [key for key in _REQUIRED_KEYS if key not in data]
    if missing:
        raise RecipeError(f"recipe file {path}: missing key(s) {', '.join(missing)}")
    if data["name"] != path.stem:
        raise RecipeError(f"recipe file {path}: name {data['name']!r} must be the file's stem {path.stem!r}")
    parameters = {key: _parameter(path, key, entry) for key, entry in (data.get("parameters") or {}).items()}
    summary = " ".join(str(data["summary"]).split())
    return RecipeSpec(data["name"], data["function"], summary, parameters, tuple(data.get("constraints") or ()))


def _parameter(path: Path, key: str, entry: Any) -> ParameterSpec:
    if not isinstance(entry, dict) or entry.get("type") not in _TYPES or "doc" not in entry:
        raise RecipeError(f"recipe file {path}: parameter {key!r} needs 'type' (one of {', '.join(_TYPES)}) and 'doc'")
    required = bool(entry.get("required", False))
    if required == ("default" in entry):
        raise RecipeError(f"recipe file {path}: parameter {key!r} needs either a 'default' or 'required: true'")
    spec = ParameterSpec(key, entry["type"], " ".join(str(entry["doc"]).split()), required, entry.get("default"))
    if not required:
        spec.check(path.stem, spec.default)
    return spec
