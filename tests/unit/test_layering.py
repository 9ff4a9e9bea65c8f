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
    "launch": {"ir", "runtime"},  # ir.errors: the package's one base exception  # runtime.failures: the first failing rank, named across ranks
    "recipes": set(),
    "capture": {"ir"},
    "primitives": {"ir"},
    "program": set(),  # the step's actions, buckets and lowering passes: plain data every later stage reads
    "schedules": {"ir", "program"},
    "plans": {"ir", "primitives", "schedules"},
    "materialize": {"ir", "program"},
    "codegen": {"ir", "materialize", "program"},
    "runtime": {"ir", "program"},
    "verify": {"ir", "primitives"},  # replica_reference cuts BatchNorm per replica with op_trans
    "checkpoint": {"ir"},
    "init": {"ir"},  # deferred initialization: a module recorded on meta, its pieces materialized per rank
    "checkpoint_hint": {"checkpoint"},
    "logged_values": {"ir", "capture", "plans"},
    "replica_buffers": {"ir", "capture"},
    "explain": {"ir", "materialize", "plans", "program"},  # ZeRO-3's gathered windows are the program's GATHER / FREE
    "plan": {
        "ir", "capture", "plans", "schedules", "program", "materialize", "codegen", "runtime", "verify", "draw", "explain", "logged_values",
        "replica_buffers", "sim",
    },
    "strategy": {"ir", "capture", "plans", "codegen", "runtime", "checkpoint", "init", "plan", "explain", "sim"},
    "data": set(),
    "draw": {"explain", "sim"},  # the picture is the simulator's timeline
    "sim": {"ir", "materialize", "schedules", "program", "plans", "explain"},  # the simulator reads plans; nothing below imports it
    "app": {"ir", "data", "draw", "explain", "plan", "plans", "sim", "strategy"},
    "train": {"app"},
    "cli": {"ir", "plans", "recipes", "checkpoint", "plan", "app"},
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


def module_constants(folder: str) -> dict[str, Path]:
    """Module-level UPPER_CASE names assigned in the modules of ``folder`` (a stage), by name."""
    found = {}
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
            found.update({target.id: path for target in targets if isinstance(target, ast.Name) and target.id.isupper()})
    return found


def test_the_simulator_copies_no_runtime_constant() -> None:
    """A value the runtime uses (a bucket size) is the program's, imported by both, so the simulator prices what runs."""
    copied = sorted(set(module_constants("sim")) & set(module_constants("runtime")))
    assert not copied, f"sim/ and runtime/ each define {copied}: define it once where both import it (program/)"


def test_only_the_schedules_and_the_program_lowering_make_actions() -> None:
    """Nothing but the schedule generators and program/'s passes orders actions; the runtime only reads its PROGRAM."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        stage = path.relative_to(PACKAGE).parts[0]
        if stage in ("program", "schedules"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = ast.unparse(node.func)
                if name in ("Action", "Action.step") or (name == "Action.parse" and stage != "runtime"):
                    offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {name}(...)")
    assert not offenders, offenders
