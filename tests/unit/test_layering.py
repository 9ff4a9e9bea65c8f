"""Imports flow one way down the pipeline (DESIGN.md §2), and no module reaches into another stage's private names.

Stages are the top-level modules and packages of ``lightning_nnscaler``; each may import only the
stages listed for it here. A new stage, or a new dependency, is a decision: add it to the table.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_nnscaler"

ALLOWED: dict[str, set[str]] = {
    "_import_hooks": set(),
    "ir": set(),
    "models": set(),
    "launch": {"runtime"},  # runtime.failures: the first failing rank, named across ranks
    "recipes": set(),
    "capture": {"ir"},
    "primitives": {"ir"},
    "schedules": {"ir"},
    "plans": {"ir", "primitives", "schedules"},
    "materialize": {"ir"},
    "codegen": {"ir", "materialize"},
    "runtime": {"ir"},
    "verify": {"ir", "primitives"},  # replica_reference cuts BatchNorm per replica with op_trans
    "checkpoint": {"ir"},
    "init": {"ir"},  # deferred initialization: a module recorded on meta, its pieces materialized per rank
    "checkpoint_hint": {"checkpoint"},
    "logged_values": {"ir", "capture", "plans"},
    "replica_buffers": {"ir", "capture"},
    "explain": {"ir", "materialize", "plans"},
    "parallelize": {
        "ir", "capture", "plans", "schedules", "materialize", "codegen", "runtime", "verify", "draw", "explain", "logged_values", "replica_buffers", "sim",
    },
    "strategy": {"ir", "capture", "plans", "codegen", "runtime", "checkpoint", "init", "parallelize", "explain", "sim"},
    "data": set(),
    "draw": {"explain", "sim"},  # the picture is the simulator's timeline
    "sim": {"ir", "materialize", "schedules", "plans", "explain"},  # the simulator reads plans; nothing below imports it
    "app": {"data", "draw", "explain", "parallelize", "plans", "sim", "strategy"},
    "train": {"app"},
    "cli": {"ir", "plans", "recipes", "checkpoint", "parallelize", "app"},
}


def imports() -> list[tuple[Path, str, str, list[str]]]:
    """``(file, importing stage, imported module, imported names)`` for every project import."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        stage = parts[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lightning_nnscaler":
                found.append((path, stage, node.module, [alias.name for alias in node.names]))
            elif isinstance(node, ast.Import):
                found += [(path, stage, alias.name, []) for alias in node.names if alias.name.split(".")[0] == "lightning_nnscaler"]
    return found


def imported_stage(module: str, names: list[str]) -> list[str]:
    parts = module.split(".")
    return [parts[1]] if len(parts) > 1 else names  # `from lightning_nnscaler import checkpoint`


def test_every_stage_imports_only_earlier_stages() -> None:
    stages = {path.relative_to(PACKAGE).with_suffix("").parts[0] for path in PACKAGE.rglob("*.py")} - {"__init__"}
    assert stages <= set(ALLOWED), f"stages missing from the table: {sorted(stages - set(ALLOWED))}"
    wrong = [
        f"{path.relative_to(PACKAGE)} ({stage}) imports {module} ({target})"
        for path, stage, module, names in imports() if stage != "__init__"
        for target in imported_stage(module, names) if target != stage and target not in ALLOWED[stage]
    ]
    assert not wrong, "\n".join(wrong)


def test_no_module_imports_another_stages_private_names() -> None:
    wrong = [
        f"{path.relative_to(PACKAGE)} imports {name} from {module}"
        for path, stage, module, names in imports()
        for name in names
        if name.startswith("_") and name != "__version__" and imported_stage(module, [name])[0] != stage
    ]
    assert not wrong, "\n".join(wrong)


def test_nothing_outside_the_strategy_imports_its_private_names() -> None:
    tests = Path(__file__).resolve().parents[1]
    offenders = []
    for path in [*PACKAGE.rglob("*.py"), *tests.rglob("*.py"), *(tests.parent / "benchmarks").rglob("*.py")]:
        if PACKAGE / "strategy" in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_nnscaler.strategy"):
                offenders += [f"{path.name}: {alias.name}" for alias in node.names if alias.name.startswith("_")]
    assert not offenders, offenders
