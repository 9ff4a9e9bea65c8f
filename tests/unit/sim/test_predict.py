"""``predict`` on a small traced plan: the activation peak over the schedule is below ``explain``'s every-output count."""

from __future__ import annotations

import pytest
import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.sim import predict


@pytest.fixture(scope="module")
def gpt_and_batch():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, seq_len=16, hidden=32, layers=2, heads=2))
    model.log = lambda *args, **kwargs: None
    return model, model.example_batch(4, torch.Generator().manual_seed(0))


@pytest.mark.parametrize("recipe, params", [("1f1b", {"stages": 2, "microbatches": 2}), ("tp", {}), ("zero3", {})])
def test_predicted_memory_is_explains_and_the_step_takes_time(gpt_and_batch, recipe: str, params: dict) -> None:
    model, batch = gpt_and_batch
    plan = lnn.parallelize(model, batch, recipe, 2, step="training_step", **params)
    prediction = predict(plan, "a100")
    assert prediction.step_seconds > 0
    rows = plan.memory_rows()  # both count what autograd saves (materialize.kept), the simulation at its peak over the schedule
    assert all(0 < predicted["activations"] == row["activations"] for predicted, row in zip(prediction.memory, rows, strict=True))
    assert all(rank.busy > 0 for rank in prediction.simulation.ranks)


def test_explain_with_a_spec_ends_with_the_predicted_step(gpt_and_batch) -> None:
    model, batch = gpt_and_batch
    plan = lnn.parallelize(model, batch, "1f1b", 2, step="training_step", stages=2, microbatches=2)
    assert plan.explain() == plan.explain(None)
    last = plan.explain("h100").splitlines()[-1]
    assert last.startswith("predicted step on H100-SXM5-80GB: ") and "bubble" in last
