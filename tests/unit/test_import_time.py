"""``import lightning_nnscaler`` then ``import lightning`` (the strategies registered) costs at most
Lightning's own import + 1 s (benchmarks/import_time.py).

Median of 3 fresh processes each, interleaved. The check is on CPU time (user + sys of the child):
on a loaded shared 2-core machine the wall time mostly measures waiting for a core. The benchmark
prints wall time too.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "import_time.py"


def load_benchmark():
    spec = importlib.util.spec_from_file_location("import_time_benchmark", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_import_costs_at_most_lightnings_plus_one_second() -> None:
    benchmark = load_benchmark()
    rounds = 3
    # No warm-up round: this pytest process already imported both (bytecode and page cache are warm).
    timings = benchmark.measure(["lightning", "lightning_nnscaler+lightning"], rounds, warmup=False)
    difference = timings["lightning_nnscaler+lightning"].cpu_s - timings["lightning"].cpu_s
    assert difference <= benchmark.GOAL_S, (
        f"import lightning_nnscaler, lightning costs {difference:+.2f} s CPU over import lightning (goal <= {benchmark.GOAL_S} s); "
        f"find what it imports with `python -X importtime -c 'import lightning_nnscaler, lightning'`\n"
        + benchmark.table(timings, rounds)
    )
