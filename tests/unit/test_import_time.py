"""After ``import lightning``, ``import lightning_nnscaler`` (which registers the strategies) loads only
this package's own modules and a short, named list of small third-party ones: nothing heavy.

What an import costs in seconds depends on the machine (Lightning alone took 3 s here and 9 s on the
CI runner), so the goal in seconds (at most Lightning's import + 1 s) lives in
``benchmarks/import_time.py``, which times it. This test checks the cause that keeps the import cheap,
exactly and on any machine: which modules the import adds. A new dependency imported at module level
(matplotlib, hydra, wandb, torch.export, sympy, ...) fails here, naming it; import it where it is used.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "import_time.py"

# Modules outside this package that ``import lightning_nnscaler`` may add to what Lightning imports, and why.
ALLOWED_EXTRA_MODULES = {
    "xxhash": "checkpoint shard checksums (a small C extension)",
    "torch.distributed.fsdp.sharded_grad_scaler": "16-mixed precision plugin's grad scaler for sharded gradients",
}


def load_benchmark():
    spec = importlib.util.spec_from_file_location("import_time_benchmark", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


_ADDED_BY_THE_PACKAGE = """
import json, sys
before = set(sys.modules)
import lightning_nnscaler
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def test_importing_the_package_with_lightning_adds_only_its_own_modules_and_named_small_ones() -> None:
    """One fresh interpreter: ``import lightning`` (with the torchvision shim the baseline needs), then what
    ``import lightning_nnscaler`` adds to it (the strategies registered with Lightning's registry)."""
    benchmark = load_benchmark()
    code = benchmark.CANDIDATES["lightning"] + _ADDED_BY_THE_PACKAGE
    finished = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=benchmark.clean_environment(), timeout=300)
    assert finished.returncode == 0, f"the import failed:\n{finished.stderr[-3000:]}"
    added = set(json.loads(finished.stdout.strip().splitlines()[-1]))
    own = {name for name in added if name == "lightning_nnscaler" or name.startswith("lightning_nnscaler.")}
    assert "lightning_nnscaler.strategy" in own, f"the strategies were not registered: {sorted(own)}"
    foreign = sorted(
        name
        for name in added - own
        if not any(name == allowed or name.startswith(allowed + ".") for allowed in ALLOWED_EXTRA_MODULES)
    )
    assert not foreign, (
        f"import lightning_nnscaler after import lightning loads {len(foreign)} module(s) that import lightning does not and "
        f"that are not on the allowed list: {foreign[:40]}; import them where they are used (inside the function), "
        f"or, if small and needed at import, add them to ALLOWED_EXTRA_MODULES with the reason. "
        f"Find who imports them with `python -X importtime -c 'import lightning, lightning_nnscaler'`."
    )
