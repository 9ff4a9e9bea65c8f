"""Pipeline schedules train on real gloo processes exactly like a single device (AdamW, 10 steps): every
schedule on GPT, 1F1B on the Swin and mBART-style references, and 3F1B on the Evoformer reference
with recycling (r = 3)."""

from __future__ import annotations

import pytest
import torch

from lightning_nnscaler.launch import launch
from lightning_nnscaler.runtime.executor import Shard, merge_shards

from workers import STEPS, plan_recipes, single_device_run, train_planned  # noqa: E402 - tests/integration is on sys.path


def pipelines_for(world_size: int) -> list[tuple[str, str, dict]]:
    """(label, catalog recipe, parameters): every schedule over all ranks; at 4 ranks also dp 2 × tp 1 × pp 2."""
    recipes = [
        ("gpipe", "gpipe", {}),
        ("1f1b", "1f1b", {}),
        ("interleaved", "interleaved", {"virtual_stages": 2}),
        ("zb1", "zb1", {}),
    ]
    if world_size == 4:
        recipes.append(("hybrid3d 2x1x2", "hybrid3d", {"dp": 2, "tp": 1, "pp": 2}))
    return recipes


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [2, 4])
def test_pipelines_match_single_device_training(world_size: int) -> None:
    expected_losses, expected_parameters = single_device_run("gpt")
    recipes = pipelines_for(world_size)
    per_rank = launch(train_planned, world_size, "gpt", plan_recipes("gpt", world_size, recipes), timeout=500)  # planned once, here
    shapes = {key: tuple(value.shape) for key, value in expected_parameters.items()}
    for label, _, _ in recipes:
        for rank, results in enumerate(per_rank):
            losses = results[label]["losses"]
            assert len(losses) == STEPS
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-5, atol=1e-6, msg=lambda m, r=label, k=rank: f"{r} rank {k} losses: {m}")
        shards = [{str(i): Shard(location, tensor) for i, (location, tensor) in enumerate(results[label]["shards"])} for results in per_rank]
        merged = merge_shards(shards, shapes)
        assert merged.keys() == expected_parameters.keys(), label
        for key, value in expected_parameters.items():
            torch.testing.assert_close(merged[key], value, rtol=1e-5, atol=1e-5, msg=lambda m, r=label, k=key: f"{r} parameter {k}: {m}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model_name", ["swin", "mbart"])
def test_1f1b_matches_single_device_training_of_the_vision_and_encoder_decoder_references(model_name: str) -> None:
    expected_losses, expected_parameters = single_device_run(model_name)
    per_rank = launch(train_planned, 4, model_name, plan_recipes(model_name, 4, [("1f1b", "1f1b", {})]), timeout=500)
    for rank, results in enumerate(per_rank):
        torch.testing.assert_close(torch.tensor(results["1f1b"]["losses"]), torch.tensor(expected_losses), rtol=1e-5, atol=1e-6, msg=lambda m, k=rank: f"rank {k} losses: {m}")
    shards = [{str(i): Shard(location, tensor) for i, (location, tensor) in enumerate(results["1f1b"]["shards"])} for results in per_rank]
    merged = merge_shards(shards, {key: tuple(value.shape) for key, value in expected_parameters.items()})
    assert merged.keys() == expected_parameters.keys()
    for key, value in expected_parameters.items():
        torch.testing.assert_close(merged[key], value, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{model_name} parameter {k}: {m}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [2, 4])
def test_3f1b_matches_single_device_training_of_a_recycling_model(world_size: int) -> None:
    expected_losses, expected_parameters = single_device_run("evoformer")
    per_rank = launch(train_planned, world_size, "evoformer", plan_recipes("evoformer", world_size, [("3f1b", "3f1b", {})]), timeout=500)
    for rank, results in enumerate(per_rank):
        torch.testing.assert_close(torch.tensor(results["3f1b"]["losses"]), torch.tensor(expected_losses), rtol=1e-5, atol=1e-6, msg=lambda m, k=rank: f"rank {k} losses: {m}")
    shards = [{str(i): Shard(location, tensor) for i, (location, tensor) in enumerate(results["3f1b"]["shards"])} for results in per_rank]
    merged = merge_shards(shards, {key: tuple(value.shape) for key, value in expected_parameters.items()})
    assert merged.keys() == expected_parameters.keys()
    for key, value in expected_parameters.items():
        # The pair-bias LayerNorm's bias shifts every logit of a softmax row alike, so its true gradient is
        # zero and AdamW's updates are normalized rounding noise: measured up to 4.1e-5 after 10 steps.
        atol = 1e-4 if key.endswith("msa_row_attention.norm_z.bias") else 1e-5
        torch.testing.assert_close(merged[key], value, rtol=1e-5, atol=atol, msg=lambda m, k=key: f"parameter {k}: {m}")
