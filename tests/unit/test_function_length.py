"""No function longer than 60 lines in the stages that hold the plan and the step (DESIGN.md §7: functions ≲ 60).

A longer function is split into named steps (``plans.pipeline.pipeline``: the grid, the order, the cut, the
placement), so a reader holds one in their head. The count runs from the ``def`` line to the last line of
the body, docstring included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_nnscaler"
CHECKED = ("plans", "program", "runtime")
MOST_LINES = 60


def long_functions(folder: Path, most: int = MOST_LINES) -> list[str]:
    """``"path:line name (n lines)"`` for each function or method under ``folder`` longer than ``most`` lines."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > most:
                    found.append(f"{path.relative_to(folder.parent)}:{node.lineno} {node.name} ({lines} lines)")
    return found


@pytest.mark.parametrize("stage", CHECKED)
def test_no_function_is_longer_than_60_lines(stage: str) -> None:
    assert (PACKAGE / stage).is_dir(), stage
    long = long_functions(PACKAGE / stage)
    assert not long, f"split these into named steps of at most {MOST_LINES} lines:\n" + "\n".join(long)


def test_the_scan_finds_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    value = {index}" for index in range(MOST_LINES))
    (tmp_path / "long.py").write_text(f"def long() -> None:\n{body}\n")
    assert [entry.split(" ", 1)[1] for entry in long_functions(tmp_path)] == ["long (61 lines)"]
