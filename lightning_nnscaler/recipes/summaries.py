"""The built-in recipes' names, summaries and parameters, read without importing the plan functions.

``lightning_nnscaler.plans.catalog`` imports each recipe's function (and with it torch) to read its
config dataclass. ``lightning-nnscaler recipes`` only prints the parameters, so it reads the same facts
from the source: each catalog file, and in the module its ``function`` names, the ``def`` of that
function; then the class its ``config`` parameter is annotated with (in that module, or imported into
it from another), its fields and those of the dataclasses it derives from (annotations and literal
defaults, ``field(default=...)`` too), or else the function's keyword-only parameters. Whatever cannot
be read that way (a function that is not a plain top-level ``def``, a decorated one, an annotation or
default that is not spelled literally) raises ``UnreadableRecipe``, and the caller asks the catalog instead.
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
_TUPLE_ENTRIES = ("int", "str")


class UnreadableRecipe(LookupError):
    """A recipe whose parameters cannot be read from its source without importing it."""


@dataclass(frozen=True)
class ParameterSummary:
    """One parameter of a recipe (a field of its config), as the catalog's ``ParameterSpec`` describes it."""

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
    source = _source_file(module_name)
    function = _function_definition(source, function_name)
    positional = function.args.posonlyargs + function.args.args
    if len(positional) >= 3:
        parameters = _fields(*_class_definition(source, _annotation_name(positional[2].annotation)))
    else:
        parameters = _parameters(function)
    return RecipeSummary(str(data["name"]), " ".join(str(data["summary"]).split()), parameters)


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


def _annotation_name(node: ast.expr | None) -> str:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        node = ast.parse(node.value, mode="eval").body
    if not isinstance(node, ast.Name):
        raise UnreadableRecipe(f"config annotation {ast.unparse(node) if node else '(none)'} is not a class name")
    return node.id


def _class_definition(source: Path, name: str) -> tuple[Path, ast.ClassDef]:
    """``(its source file, the class)``: defined in ``source``, or imported into it from a module of a source file."""
    tree = ast.parse(source.read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return source, node
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return _class_definition(_source_file(node.module), alias.name)
    raise UnreadableRecipe(f"{source}: no top-level class {name}")


def _fields(source: Path, definition: ast.ClassDef) -> dict[str, ParameterSummary]:
    """A dataclass's fields in dataclass order: its bases' first (a field redeclared keeps its place)."""
    fields: dict[str, ParameterSummary] = {}
    for base in definition.bases:
        fields.update(_fields(*_class_definition(source, _annotation_name(base))))
    for node in definition.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            type_name, nullable = _annotation(node.annotation)
            required, default = _field_default(node.value, node.target.id)
            fields[node.target.id] = ParameterSummary(node.target.id, type_name, required, default, nullable)
    return fields


def _field_default(value: ast.expr | None, name: str) -> tuple[bool, Any]:
    """``(required, default)`` of a field's right-hand side: none, a literal, or ``field(default=<literal>, ...)``."""
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "field":
        keywords = {keyword.arg: keyword.value for keyword in value.keywords}
        if "default_factory" in keywords:
            raise UnreadableRecipe(f"field {name}: a default_factory is not a literal")
        value = keywords.get("default")
    if value is None:
        return True, None
    try:
        return False, ast.literal_eval(value)
    except ValueError as error:
        raise UnreadableRecipe(f"field {name}: its default is not a literal") from error


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
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "tuple":
        entries = node.slice.elts if isinstance(node.slice, ast.Tuple) else []
        if len(entries) == 2 and isinstance(entries[0], ast.Name) and entries[0].id in _TUPLE_ENTRIES:
            if isinstance(entries[1], ast.Constant) and entries[1].value is Ellipsis:
                return f"tuple[{entries[0].id}, ...]", False
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
    raise UnreadableRecipe(
        f"annotation {ast.unparse(node) if node else '(none)'} is not int, bool, float, str, tuple[int, ...] or tuple[str, ...] (optionally | None)"
    )
