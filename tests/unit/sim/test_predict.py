"""``predict`` on a small traced plan: the activation peak over the schedule is below ``explain``'s every-output count."""

from __future__ import annotations

import pytest
import torch
import yaml

import lightning_nnscaler as lnn
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.sim import load_spec, predict
from lightning_nnscaler.sim.costs import Roofline
from lightning_nnscaler.sim.from_plan import plan_task_lists
from lightning_nnscaler.sim.predict import DeviceModel
from lightning_nnscaler.sim.tasks import Collective, Compute, WaitCollectives
from lightning_nnscaler.sim.specs import SPEC_DIRECTORY, spec_from_dict


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


def test_the_in_step_factor_may_be_given_per_world_size_and_prices_each_plan_by_its_ranks(gpt_and_batch) -> None:
    model, batch = gpt_and_batch
    data = yaml.safe_load((SPEC_DIRECTORY / "cpu.yaml").read_text())
    flat, by_ranks = spec_from_dict({**data, "in_step_factor": 1.5}), spec_from_dict({**data, "in_step_factor": {2: 1.5, 4: 3.0}})
    assert (by_ranks.in_step(2), by_ranks.in_step(4), by_ranks.in_step(8), by_ranks.in_step(None)) == (1.5, 3.0, 3.0, 1.5)
    two, four = (lnn.parallelize(model, batch, "dp", ranks, step="training_step") for ranks in (2, 4))
    assert predict(two, by_ranks).step_seconds == predict(two, flat).step_seconds
    computes = [[task.seconds for task in plan_task_lists(four, DeviceModel(spec, Roofline(spec)).for_ranks(4))[0] if isinstance(task, Compute)]
                for spec in (flat, by_ranks)]
    assert computes[1] == pytest.approx([2 * seconds for seconds in computes[0]])


@pytest.mark.parametrize("recipe, params", [("1f1b", {"stages": 2, "microbatches": 2}), ("dp", {})])
def test_the_loss_is_summed_where_the_runtime_sums_it(gpt_and_batch, recipe: str, params: dict) -> None:
    """runtime.executor: a pipeline sums the loss once its gradient sums are done and waits for it before the
    optimizer step; another plan starts the sum before its gradient buckets and waits for them together."""
    model, batch = gpt_and_batch
    plan = lnn.parallelize(model, batch, recipe, 4, step="training_step", **params)
    spec = load_spec("cpu")
    for tasks in plan_task_lists(plan, DeviceModel(spec, Roofline(spec)).for_ranks(4)):
        tail = [(type(task).__name__, task.label) for task in tasks if isinstance(task, (Collective, WaitCollectives, Compute))
                and task.label in ("LOSS", "REDUCE b0", "STEP")]
        loss_sum = next(task for task in tasks if isinstance(task, Collective) and task.label == "LOSS")
        expected = [("Collective", "REDUCE b0"), ("WaitCollectives", "LOSS"), ("Collective", "LOSS"), ("Compute", "STEP")] if recipe == "1f1b" else [
            ("Collective", "LOSS"), ("Collective", "REDUCE b0"), ("WaitCollectives", "STEP"), ("Compute", "STEP")]
        assert tail == expected
        assert loss_sum.blocking == (recipe == "1f1b") and loss_sum.group == (0, 1, 2, 3)
