"""Fail unless the installed torch is the version pinned in constraints.txt (its local label, e.g. +cpu, aside).

    python .ci/check_torch_pin.py [CONSTRAINTS]      (default: constraints.txt beside .ci/)

Run by .ci/run after the README's install and by .ci/wheel_check.sh inside the wheel's fresh virtual
environment, each with that environment's python.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def pinned(constraints: Path, package: str) -> str:
    """The version after ``package==`` in the constraints file."""
    for line in constraints.read_text().splitlines():
        match = re.fullmatch(rf"\s*{re.escape(package)}\s*==\s*([^\s;#]+)\s*(#.*)?", line, flags=re.IGNORECASE)
        if match:
            return match.group(1)
    sys.exit(f"check_torch_pin: {constraints} pins no {package}==VERSION")


def main() -> None:
    constraints = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "constraints.txt"
    expected = pinned(constraints, "torch")
    import torch

    installed = torch.__version__
    public = str(installed).split("+", 1)[0]
    if public != expected:
        sys.exit(
            f"check_torch_pin: installed torch is {installed} ({torch.__file__}), but {constraints.name} pins torch=={expected}. "
            f"Install with `pip install -c constraints.txt ...` (the README's set-up) so nothing drags torch to another release."
        )
    print(f"check_torch_pin: torch {installed} matches the pin torch=={expected} ({sys.prefix})")


if __name__ == "__main__":
    main()
