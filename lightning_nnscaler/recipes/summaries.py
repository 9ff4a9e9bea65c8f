"""The built-in recipes' names, summaries and parameters, read without importing the plan functions.

``lightning_nnscaler.plans.catalog`` imports each recipe's function (and with it torch) to read its
keyword-only parameters. ``lightning-nnscaler recipes`` only prints them, so it reads the same facts
from the source: each catalog file, and in the module its ``function`` names, the ``def`` of that
function (annotations and literal defaults). Whatever cannot be read that way (a function that is
not a plain top-level ``def``, a decorated one, an annotation or default that is not spelled
literally) raises ``UnreadableRecipe``, and the caller asks the catalog instead.
``tests/unit/test_cli_startup.py`` checks that both give the same answer for every built-in recipe.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

RECIPES_DIR = Path(__file__).resolve().parent
_TYPE_NAMES = ("int", "bool", "float", "str")


class UnreadableRecipe(LookupError):
    """A recipe whose parameters cannot be read from its source without importing it."""


@dataclass(frozen=True)
class ParameterSummary:
    """One keyword parameter of a recipe function, as the catalog's ``ParameterSpec`` describes it."""

    name: str
    type: str
    required: bool
    default: Any
    nullable: bool


@dataclass(frozen=True)
class RecipeSummary:
    """A built-in recipe: its name, its one-paragraph summary and its parameters in signature order."""

    name: str
    summary: str
    parameters: dict[str, ParameterSummary]


def built_in_summaries() -> list[RecipeSummary]:
    """Every built-in recipe (``recipes/*.yaml``), sorted by name, read without importing its function.

    Raises:
        UnreadableRecipe: a file or function that only the catalog (which imports it) can read.
    """
    summaries = [_summary(path) for path in RECIPES_DIR.glob("*.yaml")]
    return sorted(summaries, key=lambda summary: summary.name)


def _summary(path: Path) -> RecipeSummary:
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict) or not {"name", "function", "summary"} <= set(data):
        raise UnreadableRecipe(f"{path}: not a complete recipe file")
    module_name, _, function_name = str(data["function"]).partition(":")
    function = _function_definition(_source_file(module_name), function_name)
    return RecipeSummary(str(data["name"]), " ".join(str(data["summary"]).split()), _parameters(function))


def _source_file(module_name: str) -> Path:
    """The ``.py`` file of ``module_name``, found without importing it or its parent packages."""
    parts = module_name.split(".")
    spec = importlib.util.find_spec(parts[0])  # a top-level name: found, not imported
    for depth in range(2, len(parts) + 1):
        if spec is None or spec.submodule_search_locations is None:
            break
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:depth]), list(spec.submodule_search_locations))
    if spec is None or spec.name != module_name or not spec.origin or not spec.origin.endswith(".py"):
        raise UnreadableRecipe(f"no source file for module {module_name!r}")
    return Path(spec.origin)


def _function_definition(source: Path, name: str) -> ast.FunctionDef:
    definitions = [
        node for node in ast.parse(source.read_text()).body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign, ast.ImportFrom))
        and name in _names_bound(node)
    ]
    if len(definitions) != 1 or not isinstance(definitions[0], ast.FunctionDef) or definitions[0].decorator_list:
        raise UnreadableRecipe(f"{source}: {name} is not one plain top-level def")
    return definitions[0]


def _names_bound(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, ast.ImportFrom):
        return {alias.asname or alias.name for alias in node.names}
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return {name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name)}


def _parameters(function: ast.FunctionDef) -> dict[str, ParameterSummary]:
    parameters = {}
    for argument, default in zip(function.args.kwonlyargs, function.args.kw_defaults):
        type_name, nullable = _annotation(argument.annotation)
        required = default is None
        try:
            value = None if required else ast.literal_eval(default)
        except ValueError as error:
            raise UnreadableRecipe(f"{function.name}: the default of {argument.arg} is not a literal") from error
        parameters[argument.arg] = ParameterSummary(argument.arg, type_name, required, value, nullable)
    return parameters


def _annotation(node: ast.expr | None) -> tuple[str, bool]:
    """``(type name, accepts None)`` of an annotation spelled ``T``, ``T | None`` or ``Optional[T]``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return _annotation(ast.parse(node.value, mode="eval").body)
    if isinstance(node, ast.Name) and node.id in _TYPE_NAMES:
        return node.id, False
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        sides = [node.left, node.right]
        nones = [side for side in sides if isinstance(side, ast.Constant) and side.value is None]
        if len(nones) == 1:
            (other,) = [side for side in sides if side is not nones[0]]
            type_name, _ = _annotation(other)
            return type_name, True
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "Optional":
        type_name, _ = _annotation(node.slice)
        return type_name, True
    raise UnreadableRecipe(f"annotation {ast.unparse(node) if node else '(none)'} is not int, bool, float or str (optionally | None)")
