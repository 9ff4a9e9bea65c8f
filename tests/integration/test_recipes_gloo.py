"""Every recipe trains on real gloo processes exactly like a single device (AdamW, 10 steps): on GPT at
4 ranks (hybrid is dp 2 x tp 2 there: real sub-groups) and on Swin at 2 ranks; in the 2-rank launch
also the interlaced pipeline on the mBART-style reference and GPT's gpipe, 1f1b, interleaved and zb1
pipelines (their 4-rank runs are in test_pipelines_gloo.py), 1f1b and zb1 with their first stage recomputed.

Each recipe runs on real processes at 2 and at 4 ranks, on each model at least once. The other two
pairings are proven by verify() at virtual ranks (the same generated code, run in one process):
GPT at 2 ranks, every recipe, in tests/unit/plans/test_recipes_equivalence.py (test_gpt_small), and
Swin at 4 ranks, every recipe (the partial plans included), there too (test_swin).
"""

from __future__ import annotations

import pytest

from lightning_nnscaler.materialize import AlphaBeta
from support.ranks import launch_ranks

from workers import assert_trains_like_one_device, plan_recipes, single_device_run, train_planned_models  # noqa: E402 - tests/integration is on sys.path


GPT_PIPELINES = [
    ("gpipe", "gpipe", {}), ("1f1b", "1f1b", {}), ("interleaved", "interleaved", {"virtual_stages": 2}), ("zb1", "zb1", {}),
    # the first stage recomputed: checkpointed segments under 1F1B, and under zero-bubble's split B and W
    ("1f1b recompute_stages=0", "1f1b", {"recompute_stages": "0"}), ("zb1 recompute_stages=0", "zb1", {"recompute_stages": "0"}),
    # the last stage co-sharded: two pieces of each split, one after another, each recomputed alone
    ("1f1b coshard_stages=1", "1f1b", {"coshard_stages": "1", "shards": 2}),
]
ALSO_AT = {4: [], 2: [("mbart", [("interlaced", "interlaced", {})]), ("gpt", GPT_PIPELINES)]}
"""Pipelines trained in the same launch at that rank count (4 ranks: tests/integration/test_pipelines_gloo.py)."""
COLLECTIVES = {"communication_cost": AlphaBeta(alpha=0.0, launch=0.0)}  # price by volume only: collectives win


def recipes_for(model_name: str, world_size: int) -> list[tuple[str, str, dict]]:
    """(label, catalog recipe, parameters) that fit ``world_size`` ranks; tiny test tensors make the
    default cost model pick point-to-point, so tp, sp and coshard also run with collectives.

    Where the pieces do not divide the small models' heads (Swin's stages have 1 and 2 heads; GPT's
    4 heads in coshard's 8 pieces at 4 ranks) the plan keeps those attentions whole, asked for
    explicitly with ``allow_partial=True`` (``parallelize`` refuses such a plan otherwise).
    """
    partial = {"allow_partial": True} if model_name == "swin" and world_size == 4 else {}
    coshard_partial = {"allow_partial": True} if model_name == "swin" or world_size == 4 else {}
    return [
        ("dp", "dp", {}),
        ("zero1", "zero1", {}),
        ("zero3", "zero3", {}),
        ("tp", "tp", partial),
        ("tp+collectives", "tp", {**COLLECTIVES, **partial}),
        ("sp+collectives", "sp", {**COLLECTIVES, **partial}),
        ("coshard+collectives", "coshard", {"shards": 2, **COLLECTIVES, **coshard_partial}),
        ("hybrid", "hybrid", {"dp": 2, "tp": world_size // 2}),
        # auto applies one of the plans above (its search is unit-tested in tests/unit/sim/test_plan_search.py); the
        # families stay those this test trains, so the winner runs here as it runs alone, planned in seconds
        ("auto", "auto", {"recipes": "dp,zero1,zero3,tp,hybrid"}),
    ]


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("model_name", "world_size"), [("gpt", 4), ("swin", 2)])
def test_recipes_match_single_device_training(model_name: str, world_size: int) -> None:
    expected_losses, expected_parameters = single_device_run(model_name)
    recipes = recipes_for(model_name, world_size)
    planned = [(model_name, plan_recipes(model_name, world_size, recipes)), *[(other, plan_recipes(other, world_size, runs)) for other, runs in ALSO_AT[world_size]]]
    per_rank = launch_ranks(train_planned_models, world_size, planned, timeout=800)  # planned once, here
    for label, _, _ in recipes:
        assert_trains_like_one_device([results[model_name] for results in per_rank], label, expected_losses, expected_parameters)
    for other, runs in ALSO_AT[world_size]:
        other_losses, other_parameters = single_device_run(other)
        for label, _, _ in runs:
            assert_trains_like_one_device([results[other] for results in per_rank], label, other_losses, other_parameters)
