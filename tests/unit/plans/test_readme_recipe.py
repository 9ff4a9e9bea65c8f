"""The README's "Your own recipe" example runs as written: it registers, plans, verifies, and builds a Trainer."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import lightning as L
import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.models.gpt import GPT, GPTConfig

README = Path(__file__).resolve().parents[3] / "README.md"


def readme_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    return next(block for block in blocks if "register_recipe(" in block)


def test_the_readme_recipe_example_runs_as_written(monkeypatch) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig.small())
    batch = model.example_batch(4, torch.Generator().manual_seed(1))
    module = types.ModuleType("my_recipes")
    monkeypatch.setitem(sys.modules, "my_recipes", module)
    namespace = vars(module)
    namespace.update(model=model, batch=batch, L=L)
    exec(compile(readme_example(), "README.md", "exec"), namespace)  # noqa: S102 - the documented example itself
    plan = namespace["plan"]
    assert plan.data_layout.data_parallel == 2 and [plan.data_layout.replica(rank) for rank in range(4)] == [0, 0, 1, 1]
    assert lnn.load_recipe("batch_halves").parameters["replicas"].default == 2
    assert sorted(plan.planned.devices) == [0, 1, 2, 3]
