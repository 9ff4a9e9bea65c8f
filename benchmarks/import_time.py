"""Import and start-up time: ``import lightning_nnscaler`` and the command line (goals below).

    python benchmarks/import_time.py [--rounds 7]

Goals: ``import lightning_nnscaler`` followed by ``import lightning`` (which registers the strategies)
costs at most Lightning's own import + 1 s; ``lightning-nnscaler --help`` and ``lightning-nnscaler
recipes`` start in under 2 s (``import lightning_nnscaler`` alone imports neither torch nor Lightning).

Each import runs in a fresh ``python`` subprocess, the candidates interleaved round by round (so a
change in machine load hits all of them alike), after one untimed warm-up round (bytecode caches and
the page cache filled). Per candidate: the median wall time and the median CPU time (user + sys of
the child). On an idle machine the two agree; on a loaded shared machine the wall time also counts
waiting for a core, so CPU time is the steadier measure and the one ``tests/unit/test_import_time.py``
checks.

The Lightning baseline is a bare ``import lightning`` (torch's import runs the installed
``lightning_nnscaler_torchvision`` entry point in both, so both pay its cost alike).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

GOAL_S = 1.0  # import lightning_nnscaler, lightning <= import lightning + GOAL_S
CLI_GOAL_S = 2.0  # lightning-nnscaler --help, lightning-nnscaler recipes

_LIGHTNING = "import lightning"

_CLI = "import runpy, sys; sys.argv[1:] = {arguments!r}; runpy.run_module('lightning_nnscaler.cli', run_name='__main__', alter_sys=True)"

CANDIDATES: dict[str, str] = {
    "torch": "import torch",
    "lightning": _LIGHTNING,
    "lightning_nnscaler": "import lightning_nnscaler",
    "lightning_nnscaler+lightning": "import lightning_nnscaler\nimport lightning",
    "cli --help": _CLI.format(arguments=["--help"]),
    "cli recipes": _CLI.format(arguments=["recipes"]),
}
CLI_CANDIDATES = ("cli --help", "cli recipes")


@dataclass(frozen=True)
class Timing:
    """Median seconds over the rounds of one candidate."""

    wall_s: float
    cpu_s: float


def clean_environment() -> dict[str, str]:
    """The environment a fresh shell would give (what a test run left in ``os.environ`` — ranks, W&B or
    Lightning settings — must not change what an import does)."""
    kept = ("PATH", "HOME", "LANG", "TMPDIR", "PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "VIRTUAL_ENV", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
    return {name: value for name, value in os.environ.items() if name in kept}


def time_once(code: str) -> tuple[float, float]:
    """``(wall seconds, CPU seconds)`` of ``python -c code`` in a fresh process; raises if it fails."""
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=clean_environment())
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        failed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        raise RuntimeError(f"python -c {code!r} exited {process.returncode}:\n{failed.stderr[-3000:]}")
    return wall, usage.ru_utime + usage.ru_stime


def measure(names: list[str], rounds: int, warmup: bool = True) -> dict[str, Timing]:
    """Median wall and CPU time of each candidate over ``rounds`` interleaved rounds."""
    if warmup:
        for name in names:
            time_once(CANDIDATES[name])
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            samples[name].append(time_once(CANDIDATES[name]))
    return {
        name: Timing(statistics.median(wall for wall, _ in runs), statistics.median(cpu for _, cpu in runs))
        for name, runs in samples.items()
    }


def table(timings: dict[str, Timing], rounds: int) -> str:
    python = f"{Path(sys.executable).name} {sys.version.split()[0]}"
    lines = [
        f"import time, median of {rounds} fresh processes each ({python}, {os.cpu_count()} CPUs)",
        f"{'import':<30}{'wall s':>9}{'CPU s':>9}",
    ]
    lines += [f"{name:<30}{timing.wall_s:>9.2f}{timing.cpu_s:>9.2f}" for name, timing in timings.items()]
    if "lightning" in timings and "lightning_nnscaler+lightning" in timings:
        base, ours = timings["lightning"], timings["lightning_nnscaler+lightning"]
        wall, cpu = ours.wall_s - base.wall_s, ours.cpu_s - base.cpu_s
        lines.append(f"{'difference':<30}{wall:>+9.2f}{cpu:>+9.2f}   lightning_nnscaler+lightning - lightning")
        lines.append(
            f"{'goal':<30}{GOAL_S:>+9.2f}{GOAL_S:>+9.2f}   "
            f"wall {'met' if wall <= GOAL_S else 'NOT met'}, CPU {'met' if cpu <= GOAL_S else 'NOT met'}"
        )
    for name in CLI_CANDIDATES:
        if name in timings:
            timing = timings[name]
            lines.append(
                f"{'goal ' + name:<30}{CLI_GOAL_S:>9.2f}{CLI_GOAL_S:>9.2f}   "
                f"wall {'met' if timing.wall_s < CLI_GOAL_S else 'NOT met'}, CPU {'met' if timing.cpu_s < CLI_GOAL_S else 'NOT met'}"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per import (default 7)")
    arguments = parser.parse_args()
    print(table(measure(list(CANDIDATES), arguments.rounds), arguments.rounds))


if __name__ == "__main__":
    main()
