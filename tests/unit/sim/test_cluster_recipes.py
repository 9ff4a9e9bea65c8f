"""``sim.analytic.Recipe`` in the cluster model: activation recompute, ZeRO-1 and sequence parallelism.

Expected activation bytes are Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (arXiv 2205.05198), Table 2, per layer at 16 bits: no recompute ``s·b·h·(10 + 24/t + 5·a·s/(h·t))``,
with sequence parallelism ``s·b·h/t·(34 + 5·a·s/h)``; selective recompute drops the ``5·a·s/(h·t)`` term;
full recompute keeps the layer input ``2·s·b·h`` (÷ t with sequence parallelism, Megatron's sequence-split input).
"""

from __future__ import annotations

import pytest

from lightning_nnscaler.sim import load_spec
from lightning_nnscaler.sim.analytic import Recipe, TransformerShape, layer_activation_bytes
from lightning_nnscaler.sim.cluster import ClusterPlan, evaluate, optimizer_state_bytes, search_cluster, simulate_plan

GPT3 = TransformerShape(global_batch=128)  # GPT-3 175B: a 96, h 12288, s 2048, b 1
SBH = 2048 * 1 * 12288
# t = 8: 24/t = 3, 5·a·s/(h·t) = 5·96·2048/(12288·8) = 10, 34/t = 4.25
KORTHIKANTI_TABLE_2 = {
    ("none", False): SBH * (10 + 3 + 10),  # 578,813,952 B
    ("none", True): SBH * (4.25 + 10),  # 358,612,992 B
    ("selective", False): SBH * (10 + 3),  # 327,155,712 B
    ("selective", True): SBH * 4.25,  # 106,954,752 B
    ("full", False): 2 * SBH,  # 50,331,648 B
    ("full", True): 2 * SBH / 8,  # 6,291,456 B
}


@pytest.mark.parametrize(("recompute", "sequence_parallel"), list(KORTHIKANTI_TABLE_2))
def test_a_layers_activations_are_korthikantis_table_2(recompute: str, sequence_parallel: bool) -> None:
    recipe = Recipe(recompute=recompute, sequence_parallel=sequence_parallel)
    assert layer_activation_bytes(GPT3, tp=8, recipe=recipe) == KORTHIKANTI_TABLE_2[recompute, sequence_parallel]


def test_the_simulated_peak_follows_the_recompute() -> None:
    spec = load_spec("a100")
    peaks = [simulate_plan(GPT3, spec, ClusterPlan(dp=8, tp=8, pp=16, microbatch_size=1, recompute=recompute))
             .ranks[0].peak_activation_bytes
             for recompute in ("none", "selective", "full")]
    assert peaks[0] > peaks[1] > peaks[2]
    # stage 0 of 16 holds 16 microbatches in flight in 1F1B, 6 layers each
    assert peaks[1] == 16 * 6 * KORTHIKANTI_TABLE_2["selective", False]


def test_recomputing_costs_step_time() -> None:
    spec = load_spec("a100")
    none, selective, full = (simulate_plan(GPT3, spec, ClusterPlan(dp=8, tp=8, pp=16, microbatch_size=1, recompute=recompute))
                             for recompute in ("none", "selective", "full"))
    assert full.step_seconds > selective.step_seconds > none.step_seconds
    # compute (the optimizer's update included): Korthikanti et al. §5, 2.7 % more FLOPs for GPT-3; full: ×4/3
    assert selective.ranks[0].busy / none.ranks[0].busy == pytest.approx(1.027, abs=0.005)
    assert full.ranks[0].busy / none.ranks[0].busy == pytest.approx(4 / 3, abs=0.01)


def test_zero1_divides_the_optimizer_state_by_dp() -> None:
    parameters = GPT3.layers * 12 * GPT3.hidden**2
    plan = ClusterPlan(dp=8, tp=8, pp=16, microbatch_size=1, zero1=True)
    assert all(optimizer_state_bytes(GPT3, plan, stage) == 12 * parameters / (8 * 16 * 8) for stage in range(16))
    assert optimizer_state_bytes(GPT3, ClusterPlan(dp=8, tp=8, pp=16, microbatch_size=1), 0) == 12 * parameters / (8 * 16)
    spec = load_spec("a100")
    plain = evaluate(GPT3, spec, ClusterPlan(dp=8, tp=8, pp=16, microbatch_size=1), float("inf"))
    zero1 = evaluate(GPT3, spec, plan, float("inf"))
    assert plain.peak_bytes - zero1.peak_bytes == pytest.approx(12 * parameters / (8 * 16) * (1 - 1 / 8))
    assert zero1.step_seconds < plain.step_seconds  # the same ring bytes, an eighth of the update


def test_sequence_parallelism_moves_the_same_tp_bytes() -> None:
    spec = load_spec("a100")
    plain, sp = (simulate_plan(GPT3, spec, ClusterPlan(dp=8, tp=8, pp=16, microbatch_size=1, sequence_parallel=flag))
                 for flag in (False, True))
    assert sp.step_seconds == pytest.approx(plain.step_seconds, rel=1e-9)
    assert sp.ranks[0].peak_activation_bytes < plain.ranks[0].peak_activation_bytes


def test_under_a_tight_memory_limit_the_search_recomputes_or_shards_the_optimizer() -> None:
    shape = TransformerShape(layers=32, hidden=4096, seq_len=2048, vocab=50257, heads=32, global_batch=32, embeddings=True)
    plain, _ = search_cluster(shape, "a100", 16, recipes=False)
    lowest = min(outcome.peak_bytes for outcome in plain)
    outcomes, seconds = search_cluster(shape, "a100", 16, memory_limit_gb=0.7 * lowest / 1e9)
    best = outcomes[0]
    assert not best.reason and best.peak_bytes <= 0.7 * lowest and seconds < 30
    assert best.plan.recompute != "none" or best.plan.zero1
    # fitting costs time: no faster than the best plan without a limit (on the large-run terms sequence parallelism
    # also splits the blocks' memory-bound work, so a fitting sp plan may beat every plain one)
    unlimited, _ = search_cluster(shape, "a100", 16)
    assert best.step_seconds >= unlimited[0].step_seconds and best.plan != unlimited[0].plan


def test_the_default_plan_keeps_todays_step_time() -> None:
    spec = load_spec("a100")
    # snapshot taken before recipes existed (same figure, bit for bit)
    assert simulate_plan(GPT3, spec, ClusterPlan(dp=8, tp=8, pp=16, microbatch_size=1)).step_seconds == 3.013179880311065
    small = TransformerShape(layers=8, hidden=1024, seq_len=512, vocab=1000, heads=8, global_batch=32, embeddings=True)
    assert simulate_plan(small, spec, ClusterPlan(dp=2, tp=2, pp=4, microbatch_size=1)).step_seconds == 0.011775622202780292


def test_a_recipe_names_its_recompute() -> None:
    with pytest.raises(ValueError, match="recompute"):
        Recipe(recompute="some")
    plan = ClusterPlan(dp=8, tp=8, pp=16, microbatch_size=1, recompute="selective", zero1=True, sequence_parallel=True)
    assert str(plan) == "dp 8 × tp 8 × pp 16, microbatch 1, selective recompute, ZeRO-1, sp"


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_one_rank_per_stage_gives_the_rank_by_rank_result_with_every_recipe(recompute: str) -> None:
    spec = load_spec("a100")
    shape = TransformerShape(layers=8, hidden=1024, seq_len=512, vocab=1000, heads=8, global_batch=32, embeddings=True)
    plan = ClusterPlan(dp=2, tp=2, pp=4, microbatch_size=1, recompute=recompute, zero1=True, sequence_parallel=True)
    every, stages = simulate_plan(shape, spec, plan, symmetric=False), simulate_plan(shape, spec, plan)
    assert stages.step_seconds == every.step_seconds
    assert [rank.peak_live_bytes for rank in stages.ranks] == [rank.peak_live_bytes for rank in every.ranks]
    assert evaluate(shape, spec, plan, float("inf")).peak_bytes == evaluate(shape, spec, plan, float("inf"), symmetric=False).peak_bytes
