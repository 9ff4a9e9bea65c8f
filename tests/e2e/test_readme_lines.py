"""The README's "Training with Hydra" lines for your own code, run as a user runs them: from the folder
that holds the user's module (nothing else puts it on ``sys.path``), in real subprocesses, with
Lightning's launcher starting the second rank. Each line is checked to be in the README as written;
the runs add only overrides that make them short (2 steps, no logger)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
OWN_MODULE_LINE = "python -m lightning_nnscaler.train model._target_=my_package.MyModule data=synthetic"
IMPORT_LINE = "lightning-nnscaler --import my_recipes train recipe=batch_halves trainer.devices=2"
SHORT = ["trainer.max_steps=2", "logger=none"]
"""Overrides that cut a README line to a short run."""

MY_PACKAGE = '''
import torch
import lightning as L


class MyModule(L.LightningModule):
    """A two-layer regression: what data=synthetic needs is example_batch."""

    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, hidden)
        self.head = torch.nn.Linear(hidden, 1)

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        loss = torch.nn.functional.mse_loss(self.head(torch.relu(self.layer(inputs))), targets)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def example_batch(self, batch_size, generator=None):
        inputs = torch.randn(batch_size, 4, generator=generator)  # (B, 4)
        return inputs, inputs.sum(-1, keepdim=True)  # (B, 4), (B, 1)
'''

MY_RECIPES = '''
import lightning_nnscaler as lnn
from lightning_nnscaler.plans.dp import split_batch


def replicas_then_columns(world_size: int, params: dict) -> lnn.RecipeLayout:
    return lnn.RecipeLayout(lnn.DeviceGrid.of(dp=params["replicas"], model=world_size // params["replicas"]))


@lnn.register_recipe(name="batch_halves", layout=replicas_then_columns, parameter_docs={"replicas": "Data-parallel replicas."})
def batch_halves(graph: lnn.Graph, ctx: lnn.PlanContext, *, replicas: int = 2) -> None:
    """Split the batch over the replicas; inside a replica, replicate every op on each rank."""
    per_replica = ctx.world_size // replicas
    for pieces in split_batch(graph, replicas):
        for replica, piece in enumerate(pieces):
            for offset, copy in enumerate(lnn.op_trans(graph, piece, "replicate", per_replica)):
                lnn.op_assign(graph, copy, replica * per_replica + offset)
'''


def user_folder(path: Path) -> Path:
    """A folder holding the README's ``my_package`` (with ``MyModule``) and ``my_recipes.py``."""
    (path / "my_package").mkdir(parents=True)
    (path / "my_package" / "__init__.py").write_text(MY_PACKAGE)
    (path / "my_recipes.py").write_text(MY_RECIPES)
    return path


def user_environment() -> dict[str, str]:
    """The environment without PYTHONPATH: only the folder the command runs in can make the user's
    modules importable. (When the installed package is not this checkout, PYTHONPATH names the
    checkout alone, which holds no user module.)"""
    environment = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "LIGHTNING_NNSCALER_IMPORT")}
    installed = importlib.util.find_spec("lightning_nnscaler")
    if installed is None or not Path(installed.origin or "").resolve().is_relative_to(REPO):
        environment["PYTHONPATH"] = str(REPO)
    return environment


def console_script() -> str:
    """The installed ``lightning-nnscaler`` script (beside this interpreter)."""
    script = Path(sys.executable).parent / "lightning-nnscaler"
    found = str(script) if script.is_file() else shutil.which("lightning-nnscaler")
    assert found is not None, "the lightning-nnscaler console script is not installed: the README's install puts it beside python"
    return found


def run(command: list[str], cwd: Path, timeout: float, status: int = 0) -> subprocess.CompletedProcess:
    completed = subprocess.run(command, cwd=cwd, env=user_environment(), capture_output=True, text=True, timeout=timeout)
    assert completed.returncode == status, completed.stdout[-3000:] + completed.stderr[-5000:]
    return completed


def readme_line(line: str) -> list[str]:
    """The README line's words (it must be in the README as written)."""
    assert line in README, f"not in README.md: {line}"
    return line.split()


def only_result(folder: Path) -> dict:
    (result_file,) = folder.glob("outputs/*/*/result.json")
    return json.loads(result_file.read_text())


@pytest.fixture(scope="module")
def own_module_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """The README's own-module line, run once from the folder holding ``my_package``."""
    folder = user_folder(tmp_path_factory.mktemp("own_module"))
    _, *arguments = readme_line(OWN_MODULE_LINE)
    return folder, run([sys.executable, *arguments, *SHORT], folder, timeout=100)


@pytest.mark.timeout(120)
def test_own_module_by_target_trains_with_only_its_own_arguments(own_module_run: tuple[Path, subprocess.CompletedProcess]) -> None:
    """``model._target_=my_package.MyModule data=synthetic``: gpt's ``config`` is not passed on; the
    module's example_batch feeds both ranks (tp: one replica, so the global batch is batch_size)."""
    folder, completed = own_module_run
    result = only_result(folder)
    assert (result["recipe"], result["world_size"], result["steps"], result["global_batch"]) == ("tp", 2, 2, 16)
    assert "unexpected keyword argument" not in completed.stderr


@pytest.mark.timeout(120)
def test_each_lightning_info_line_prints_once(own_module_run: tuple[Path, subprocess.CompletedProcess]) -> None:
    """Lightning's INFO lines print once each, in Hydra's format (not also as Lightning's "INFO: ...")."""
    folder, completed = own_module_run
    output = completed.stdout + completed.stderr
    for line in ("GPU available: False", "Initializing distributed: GLOBAL_RANK: 0,", "Initializing distributed: GLOBAL_RANK: 1,"):
        assert output.count(line) == 1, (line, output[-4000:])
    assert "][lightning.pytorch.utilities.rank_zero][INFO] - GPU available" in output
    (log_file,) = folder.glob("outputs/*/*/train.log")
    assert "GPU available: False" in log_file.read_text()


@pytest.mark.timeout(120)
def test_a_registered_recipe_trains_on_every_rank_through_the_console_scripts_import(tmp_path: Path) -> None:
    """``lightning-nnscaler --import my_recipes train recipe=batch_halves trainer.devices=2`` from the
    folder holding my_recipes.py: the script imports it from there, and the training process and the
    rank Lightning starts import it too (each composes ``recipe=batch_halves``, a registered recipe)."""
    folder = user_folder(tmp_path)
    _, *arguments = readme_line(IMPORT_LINE)
    run([console_script(), *arguments, "model._target_=my_package.MyModule", "data=synthetic", *SHORT], folder, timeout=100)
    result = only_result(folder)
    assert (result["recipe"], result["params"], result["world_size"], result["steps"]) == ("batch_halves", {"replicas": 2}, 2, 2)
    assert result["global_batch"] == 32  # 2 replicas x batch_size 16


@pytest.mark.timeout(90)
def test_the_console_script_plans_a_module_of_the_folder_it_runs_in(tmp_path: Path) -> None:
    """``lightning-nnscaler plan`` builds the module in its own process: the folder must be on its path."""
    folder = user_folder(tmp_path)
    arguments = ["--import", "my_recipes", "plan", "--out", "plan", "model._target_=my_package.MyModule", "data=synthetic", "recipe=batch_halves", "world_size=2"]
    completed = run([console_script(), *arguments], folder, timeout=80)
    assert "rank 1: 49 parameters" in completed.stdout
    assert (folder / "plan" / "plan.png").is_file()


@pytest.mark.timeout(60)
def test_an_import_not_found_fails_in_one_line_naming_the_folder(tmp_path: Path) -> None:
    completed = run([console_script(), "--import", "no_such_recipes", "recipes"], tmp_path, timeout=50, status=2)
    assert completed.stderr.strip() == (
        f"lightning-nnscaler: --import no_such_recipes: no module 'no_such_recipes' in the current directory ({tmp_path}) "
        "or on sys.path; run from the folder that holds it or add that folder to PYTHONPATH"
    )
