"""Pipeline schedules train on real gloo processes exactly like a single device (AdamW, 10 steps): every
schedule on GPT, 1F1B on the Swin and mBART-style references, and 3F1B on the Evoformer reference
with recycling (r = 3)."""

from __future__ import annotations

import pytest

from lightning_nnscaler.launch import launch

from workers import assert_trains_like_one_device, plan_recipes, single_device_run, train_planned  # noqa: E402 - tests/integration is on sys.path


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
    for label, _, _ in recipes:
        assert_trains_like_one_device(per_rank, label, expected_losses, expected_parameters)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model_name", ["swin", "mbart"])
def test_1f1b_matches_single_device_training_of_the_vision_and_encoder_decoder_references(model_name: str) -> None:
    expected_losses, expected_parameters = single_device_run(model_name)
    per_rank = launch(train_planned, 4, model_name, plan_recipes(model_name, 4, [("1f1b", "1f1b", {})]), timeout=500)
    assert_trains_like_one_device(per_rank, "1f1b", expected_losses, expected_parameters)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [2, 4])
def test_3f1b_matches_single_device_training_of_a_recycling_model(world_size: int) -> None:
    expected_losses, expected_parameters = single_device_run("evoformer")
    per_rank = launch(train_planned, world_size, "evoformer", plan_recipes("evoformer", world_size, [("3f1b", "3f1b", {})]), timeout=500)
    # The pair-bias LayerNorm's bias shifts every logit of a softmax row alike, so its true gradient is
    # zero and AdamW's updates are normalized rounding noise: measured up to 4.1e-5 after 10 steps.
    assert_trains_like_one_device(per_rank, "3f1b", expected_losses, expected_parameters, loose={"msa_row_attention.norm_z.bias": 1e-4})
