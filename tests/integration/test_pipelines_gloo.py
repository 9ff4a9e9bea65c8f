"""Pipeline schedules train on real gloo processes exactly like a single device (AdamW, 10 steps): every
schedule on GPT, 1F1B on the Swin and mBART-style references, the interlaced pipeline on mBART, and
3F1B on the Evoformer reference with recycling (r = 3); all at 4 ranks, in one launch.

4 ranks, not 2: a 4-stage pipeline has middle stages (receive and send, both ways) besides the first
and the last, which are all a 2-stage one has. The plans themselves are proven at other rank counts
by verify() at virtual ranks (tests/unit/plans/test_pipeline.py: gpipe and 1f1b at 2, interleaved and
zb1 at 4, hybrid3d at 8 and 16, 3f1b and interlaced at 8, 1f1b on Swin and mBART at 4), 1f1b, 3f1b and
interlaced train at 2 real ranks under the Trainer (tests/e2e/test_strategy_parity.py), and interlaced on
mBART and GPT's gpipe, 1f1b, interleaved and zb1 at 2 real ranks too (tests/integration/test_recipes_gloo.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from support.ranks import launch_ranks

from workers import assert_trains_like_one_device, plan_recipes, single_device_run, train_planned_models  # noqa: E402 - tests/integration is on sys.path

WORLD_SIZE = 4
EVOFORMER_NOISY = {"msa_row_attention.norm_z.bias": 1e-4, "msa_row_attention.bias_proj.weight": 1e-4}
"""Evoformer parameters whose gradient is (nearly) zero: AdamW turns the rounding of the microbatch sums into
updates of order lr * 1e-2, which the CPU's kernels decide (an AVX-512 machine: 1.5e-5 on the pair-bias
projection after 10 steps, against 1e-5); the losses still agree at rtol 1e-5."""
PIPELINES = [
    ("gpipe", "gpipe", {}),
    ("1f1b", "1f1b", {}),
    ("interleaved", "interleaved", {"virtual_stages": 2}),
    ("zb1", "zb1", {}),
    ("hybrid3d 2x1x2", "hybrid3d", {"dp": 2, "tp": 1, "pp": 2}),
]
"""(label, catalog recipe, parameters) trained on GPT: every schedule over all ranks, and dp 2 x tp 1 x pp 2."""
RUNS = {
    "gpt": PIPELINES, "swin": [("1f1b", "1f1b", {})], "mbart": [("1f1b", "1f1b", {}), ("interlaced", "interlaced", {})],
    "evoformer": [("3f1b", "3f1b", {})],
}
"""Model name -> the pipelines it trains."""


@pytest.fixture(scope="module")
def per_rank() -> list[dict[str, dict[str, Any]]]:
    """Every rank's results (model name -> label -> losses and parameter shards) of every run in `RUNS`,
    planned here, trained in one launch."""
    planned = [(model_name, plan_recipes(model_name, WORLD_SIZE, recipes)) for model_name, recipes in RUNS.items()]
    return launch_ranks(train_planned_models, WORLD_SIZE, planned, timeout=800)


@pytest.mark.timeout(900)
def test_pipelines_match_single_device_training(per_rank: list[dict]) -> None:
    expected_losses, expected_parameters = single_device_run("gpt")
    for label, _, _ in PIPELINES:
        assert_trains_like_one_device([results["gpt"] for results in per_rank], label, expected_losses, expected_parameters)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("model_name", ["swin", "mbart"])
def test_1f1b_matches_single_device_training_of_the_vision_and_encoder_decoder_references(per_rank: list[dict], model_name: str) -> None:
    expected_losses, expected_parameters = single_device_run(model_name)
    assert_trains_like_one_device([results[model_name] for results in per_rank], "1f1b", expected_losses, expected_parameters)


@pytest.mark.timeout(900)
def test_3f1b_matches_single_device_training_of_a_recycling_model(per_rank: list[dict]) -> None:
    expected_losses, expected_parameters = single_device_run("evoformer")
    # The pair-bias LayerNorm's bias shifts every logit of a softmax row alike, so its true gradient is
    # zero and AdamW's updates are normalized rounding noise: measured up to 4.1e-5 after 10 steps.
    assert_trains_like_one_device([results["evoformer"] for results in per_rank], "3f1b", expected_losses, expected_parameters, loose=EVOFORMER_NOISY)


@pytest.mark.timeout(900)
def test_interlaced_matches_single_device_training_of_the_large_vocabulary_reference(per_rank: list[dict]) -> None:
    expected_losses, expected_parameters = single_device_run("mbart")
    assert_trains_like_one_device([results["mbart"] for results in per_rank], "interlaced", expected_losses, expected_parameters)
