"""explain() against the runtime: dp, zero1, zero3, tp and dp×tp of GPT on 4 in-memory ranks, bytes held and sent.

Each rank runs one training step (forward, backward, Adam step) with the executor and reducer the
strategy uses; the bytes of what they then hold, of the full-size tensors alive just before the
gradient reduction, and of every collective (by the ring convention of ``lightning_nnscaler.explain``)
must be the plan's rows.
"""

from __future__ import annotations

import math

import pytest
import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.explain import MEMORY_KEYS
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from support.held import one_step

WORLD = 4


def measure(plan: lnn.Plan) -> list[dict[str, int]]:
    """Per rank, after one training step: the bytes the runtime holds and sent (the keys of explain's rows)."""
    return [{key: value for key, value in row.items() if key != "gathered"} for row in one_step(plan)]


@pytest.fixture(scope="module")
def plans() -> dict[str, lnn.Plan]:
    torch.manual_seed(0)
    model = GPT(GPTConfig.small())
    batch = model.example_batch(8)
    recipes = {"dp": {}, "zero1": {}, "zero3": {}, "zero3 whole": {"stages": 1}, "tp": {}, "hybrid": {"dp": 2, "tp": 2}}
    return {
        name: lnn.parallelize(model, batch, name.split()[0], WORLD, step="training_step", **params)
        for name, params in recipes.items()
    }


@pytest.mark.parametrize("recipe", ["dp", "zero1", "zero3", "zero3 whole", "tp", "hybrid"])
def test_explain_rows_are_what_the_runtime_holds_and_sends(plans: dict[str, lnn.Plan], recipe: str) -> None:
    plan = plans[recipe]
    for rank, (row, measured) in enumerate(zip(plan.memory_rows(), measure(plan), strict=True)):
        for key, value in measured.items():
            if key == "transient" and recipe in ("zero1", "zero3 whole"):
                # One backward: each bucket is reduce-scattered as soon as its gradients are complete, so at most
                # the full gradients (explain's bound) are alive at once; how many depends on backward's order.
                assert 0 < value <= row[key], f"{recipe} rank {rank}: explain bounds the transient by {row[key]} bytes, the runtime has {value}"
                continue
            assert row[key] == value, f"{recipe} rank {rank}: explain says {key} {row[key]} bytes, the runtime has {value}"


@pytest.mark.parametrize("recipe, params", [("zero1", {}), ("zero3", {"stages": 1})])
def test_one_backward_reduce_scatters_each_bucket_as_soon_as_its_gradients_are_complete(recipe: str, params: dict) -> None:
    """The buckets are cut in reverse registration order (the order backward completes the gradients, the
    embeddings last), so a bucket is reduce-scattered, and its full gradients freed, while backward goes on."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.small())
    plan = lnn.parallelize(model, model.example_batch(8), recipe, WORLD, step="training_step", bucket_bytes=20_000, **params)
    assert len(plan.program.buckets[0]) >= 4
    whole_gradients = sum(parameter.numel() * 4 for parameter in model.parameters())
    gathered = whole_gradients if recipe == "zero3" else 0  # the whole-step zero3 holds every box through backward
    for row in measure(plan):
        assert row["transient"] - gathered < 0.3 * whole_gradients, row


def test_zero_shards_what_dp_replicates(plans: dict[str, lnn.Plan]) -> None:
    model = plans["dp"].module
    whole = sum(parameter.numel() * 4 for parameter in model.parameters())
    padding = sum((math.ceil(parameter.numel() / WORLD) * WORLD - parameter.numel()) * 4 for parameter in model.parameters())
    dp, zero1, zero3, per_layer = (plans[recipe].memory_rows()[0] for recipe in ("dp", "zero1", "zero3 whole", "zero3"))
    assert dp["parameters"] == whole and dp["optimizer"] == 2 * whole
    assert dp["gradients"] == whole  # one copy: the gradients are views of the reducer's buckets
    assert zero3["parameters"] == (whole + padding) // WORLD and whole / WORLD <= zero3["parameters"] < whole / WORLD + 4 * len(list(model.parameters()))
    assert zero1["optimizer"] == zero3["optimizer"] == (2 * whole + 2 * padding) // WORLD
    assert abs(zero1["optimizer"] - dp["optimizer"] / WORLD) <= 2 * padding / WORLD
    # Ring all-reduce: each rank sends 2(n-1)/n of the gradient bytes; ZeRO sends (n-1)/n of the padded
    # gradients (reduce-scatter) and of the padded parameters (one all-gather per step).
    assert dp["gradient_communication"] == 2 * (WORLD - 1) * whole // WORLD
    assert zero1["gradient_communication"] == zero3["gradient_communication"] == 2 * (WORLD - 1) * (whole + padding) // WORLD
    # Gathered whole for the step: every box and its gradient at once. One layer at a time (the default): the
    # layers but the last are gathered again for their backward, and the transient is the largest layer's share.
    assert zero3["transient"] == whole + (whole + padding)  # every box, and the one bucket's padded gradients
    program = plans["zero3"].program
    assert {bucket.stage for bucket in program.buckets[0]} == {0, 1}  # GPTConfig.small's two layers
    last = sum(bucket.nbytes for bucket in program.buckets[0] if bucket.stage == 1)
    assert per_layer["gradient_communication"] == zero3["gradient_communication"] + (WORLD - 1) * (whole + padding - last) // WORLD
    assert per_layer["transient"] < zero3["transient"]
    assert {key: per_layer[key] for key in ("parameters", "gradients", "optimizer")} == {key: zero3[key] for key in ("parameters", "gradients", "optimizer")}


def test_the_logged_plan_is_explains_rows(plans: dict[str, lnn.Plan]) -> None:
    from lightning_nnscaler.strategy.plan_logging import plan_summary

    plan = plans["zero3"]
    summary = plan_summary(plan)
    for rank, row in enumerate(plan.memory_rows()):
        logged = summary["memory"][f"rank{rank}"]
        assert {key: logged[f"{key}_bytes"] for key in row} == row
        assert logged["total_bytes"] == sum(row[key] for key in MEMORY_KEYS)
    assert "Adam" in summary["notes"]["optimizer"] and "Adam" in plan.explain()
