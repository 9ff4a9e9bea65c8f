"""``lightning-nnscaler --help`` and ``lightning-nnscaler recipes`` start at once: they import neither
torch nor Lightning. And ``import lightning_nnscaler``, which imports neither, still registers the
strategies with Lightning's ``StrategyRegistry`` in either import order.

The start-up check is on what the process imported (robust on a loaded machine); the wall and CPU
time it took is in the assertion message, and ``benchmarks/import_time.py`` measures it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from lightning_nnscaler.cli import recipe_line
from lightning_nnscaler.plans.catalog import list_recipes
from lightning_nnscaler.recipes.summaries import built_in_summaries

HEAVY_MODULES = ("torch", "lightning", "lightning.pytorch", "torchvision", "numpy")

_RUN_CLI_THEN_REPORT = """\
import json, runpy, sys
sys.argv[1:] = {arguments!r}
try:
    runpy.run_module("lightning_nnscaler.cli", run_name="__main__", alter_sys=True)
except SystemExit as exit:
    status = exit.code or 0
with open({report!r}, "w") as report:
    json.dump({{"status": status, "imported": [name for name in {heavy!r} if name in sys.modules]}}, report)
"""

_CHECK_REGISTRY = """
from lightning.pytorch.strategies import StrategyRegistry
from lightning_nnscaler import NnScalerStrategy
missing = [name for name in ("nnscaler", "nnscaler_spawn", "nnscaler_dp", "nnscaler_tp", "nnscaler_zero3") if name not in StrategyRegistry]
assert not missing, f"not registered: {missing}"
assert StrategyRegistry["nnscaler_tp"]["strategy"] is NnScalerStrategy
"""

_BUILD_TRAINERS = """
import lightning
for name in ("nnscaler", "nnscaler_tp"):
    trainer = lightning.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False, enable_progress_bar=False)
    assert isinstance(trainer.strategy, NnScalerStrategy), (name, trainer.strategy)
print("registered")
"""

IMPORT_ORDERS = {
    "lightning_nnscaler first": "import lightning_nnscaler\nimport lightning.pytorch\n" + _CHECK_REGISTRY + _BUILD_TRAINERS,
    "lightning.pytorch first": "import lightning.pytorch\nimport lightning_nnscaler\n" + _CHECK_REGISTRY + _BUILD_TRAINERS,
    "the strategy class first": "from lightning_nnscaler import NnScalerStrategy\n" + _CHECK_REGISTRY + "print('registered')\n",
    # parallelize imports Lightning, and registering imports parallelize: it waits until parallelize is complete
    "a module that imports Lightning first": "from lightning_nnscaler.plan import Plan\n" + _CHECK_REGISTRY + "print('registered')\n",
}


def run_timed(arguments: list[str], stdout: Path) -> tuple[int, float, float]:
    """``(exit status, wall seconds, CPU seconds of the child)`` of ``python arguments``, stdout to a file."""
    with stdout.open("w") as output:
        start = time.perf_counter()
        process = subprocess.Popen([sys.executable, *arguments], stdout=output, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - start
    return os.waitstatus_to_exitcode(status), wall, usage.ru_utime + usage.ru_stime


@pytest.mark.parametrize("arguments", [["--help"], ["recipes"]], ids=" ".join)
def test_help_and_recipes_import_neither_torch_nor_lightning(arguments: list[str], tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    code = _RUN_CLI_THEN_REPORT.format(arguments=arguments, report=str(report), heavy=HEAVY_MODULES)
    exit_status, wall, cpu = run_timed(["-c", code], tmp_path / "stdout.txt")
    output = (tmp_path / "stdout.txt").read_text()
    timing = f"lightning-nnscaler {' '.join(arguments)}: {wall:.2f} s wall, {cpu:.2f} s CPU (user + sys; goal < 2 s)"
    print(timing)
    assert exit_status == 0, f"{timing}\n{output[-3000:]}"
    result = json.loads(report.read_text())
    assert result == {"status": 0, "imported": []}, f"{timing}; it imported {result['imported']}\n{output[-3000:]}"
    if arguments == ["recipes"]:
        built_ins = [recipe_line(spec) for spec in list_recipes() if spec.origin != "register_recipe"]
        assert output.splitlines() == built_ins, timing


def test_the_summaries_read_from_source_are_the_catalogs() -> None:
    catalog = {spec.name: spec for spec in list_recipes() if spec.origin != "register_recipe"}
    summaries = built_in_summaries()
    assert [summary.name for summary in summaries] == list(catalog)
    for summary in summaries:
        spec = catalog[summary.name]
        assert summary.summary == spec.summary, summary.name
        assert {name: (p.type, p.required, p.default, p.nullable) for name, p in summary.parameters.items()} == {
            name: (p.type, p.required, p.default, p.nullable) for name, p in spec.parameters.items()
        }, summary.name
        assert list(summary.parameters) == list(spec.parameters), summary.name


PUBLIC_NAMES = (
    "import lightning_nnscaler as lnn\n"
    "from lightning_nnscaler import *\n"
    "missing = [name for name in lnn.__all__ if getattr(lnn, name, None) is None or globals().get(name) is None]\n"
    "assert not missing, missing\n"
    "assert set(lnn.__all__) <= set(dir(lnn))\n"
    "import sys\n"
    "assert lnn.parallelize is sys.modules['lightning_nnscaler.plan'].parallelize, lnn.parallelize  # not the module\n"
    "assert lnn.checkpoint is sys.modules['lightning_nnscaler.checkpoint']\n"
)


@dataclass
class FreshProcess:
    """A ``python -c`` child started by `fresh_processes`, its output going to files."""

    process: subprocess.Popen
    stdout: Path
    stderr: Path

    def finish(self, timeout: float = 240) -> tuple[int, str, str]:
        """Its exit status, stdout and stderr, once it has exited."""
        return_code = self.process.wait(timeout=timeout)
        return return_code, self.stdout.read_text(), self.stderr.read_text()


@pytest.fixture(scope="module")
def fresh_processes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, FreshProcess]]:
    """Each import-order script and the public-name check in its own fresh process, all started at once:
    each imports torch and Lightning (seconds of CPU), so side by side they take the cores' time, not the sum."""
    folder = tmp_path_factory.mktemp("fresh_processes")
    children: dict[str, FreshProcess] = {}
    try:
        for index, (name, code) in enumerate({**IMPORT_ORDERS, "public names": PUBLIC_NAMES}.items()):
            stdout, stderr = folder / f"{index}.out", folder / f"{index}.err"
            with stdout.open("w") as out, stderr.open("w") as err:
                children[name] = FreshProcess(subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=err, text=True), stdout, stderr)
        yield children
    finally:
        for child in children.values():
            if child.process.poll() is None:
                child.process.kill()
                child.process.wait()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("order", list(IMPORT_ORDERS))
def test_the_strategies_are_registered_in_either_import_order(order: str, fresh_processes: dict[str, FreshProcess]) -> None:
    return_code, stdout, stderr = fresh_processes[order].finish()
    assert return_code == 0 and "registered" in stdout, f"{order}:\n{stderr[-4000:]}"


@pytest.mark.timeout(300)
def test_every_public_name_is_importable_and_an_attribute(fresh_processes: dict[str, FreshProcess]) -> None:
    return_code, _, stderr = fresh_processes["public names"].finish()
    assert return_code == 0, stderr[-4000:]
