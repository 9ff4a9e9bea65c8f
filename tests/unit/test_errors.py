"""One base exception: every error class the package defines derives from ``lightning_nnscaler.NnScalerError`` (and
keeps its built-in kind), and there is one ``DeadlockError``."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import lightning_nnscaler as lnn

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_nnscaler"


def error_classes() -> list[tuple[str, str]]:
    """``(module, class name)`` of every class named ``*Error`` defined in the package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(("lightning_nnscaler", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")
        found += [(module, node.name) for node in ast.parse(path.read_text()).body if isinstance(node, ast.ClassDef) and node.name.endswith("Error")]
    return found


def test_every_error_of_the_package_is_an_nnscaler_error() -> None:
    classes = [(module, name, getattr(importlib.import_module(module), name)) for module, name in error_classes()]
    exceptions = [(module, name, cls) for module, name, cls in classes if issubclass(cls, BaseException)]
    assert len(exceptions) > 20
    outside = [f"{module}.{name}" for module, name, cls in exceptions if not issubclass(cls, lnn.NnScalerError)]
    assert not outside, f"not NnScalerErrors: {outside}"


def test_there_is_one_deadlock_error_and_errors_keep_their_builtin_kind() -> None:
    assert [module for module, name in error_classes() if name == "DeadlockError"] == ["lightning_nnscaler.ir.validate"]
    assert issubclass(lnn.PlanError, ValueError) and issubclass(lnn.CaptureError, RuntimeError)
    from lightning_nnscaler.sim.simulate import DeadlockError

    assert issubclass(DeadlockError, lnn.PlanError)
