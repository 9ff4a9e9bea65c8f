"""Paper-scale recipes and large-run terms of the analytic cluster model (``sim.analytic``, ``sim.large_run``).

Interleaved 1F1B: Narayanan et al. 2021, §2.2.2, bubble ``(p-1)/(v·m)`` of the ideal step. The large-run terms are
fitted by ``benchmarks/simulator_paper_scale.py`` to published runs (``benchmarks/paper_scale_data.py``).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from lightning_nnscaler.sim import load_spec
from lightning_nnscaler.sim.analytic import Recipe, TransformerShape
from lightning_nnscaler.sim.cluster import ClusterPlan, cluster_plans, evaluate, search_cluster, simulate_plan
from lightning_nnscaler.sim.large_run import SUFFIX, LargeRunTerms, cluster_spec, large_run_terms
from lightning_nnscaler.sim.specs import Link

SMALL = TransformerShape(layers=8, hidden=1024, seq_len=512, vocab=1000, heads=8, global_batch=32, embeddings=True)
BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


@pytest.mark.parametrize("plan", [
    ClusterPlan(dp=2, tp=2, pp=4, microbatch_size=1, virtual_stages=2),
    ClusterPlan(dp=2, tp=2, pp=4, microbatch_size=1, recompute="selective", zero1=True, sequence_parallel=True, virtual_stages=2,
                overlap_grad_reduce=True, overlap_tp_comm=True),
    ClusterPlan(dp=2, tp=2, pp=4, microbatch_size=1, recompute="full", zero1=True, sequence_parallel=False, virtual_stages=1,
                overlap_grad_reduce=True),
    ClusterPlan(dp=4, tp=2, pp=1, microbatch_size=1, recompute="none", zero1=True, sequence_parallel=True, virtual_stages=1,
                overlap_grad_reduce=True, overlap_tp_comm=True),
])
def test_one_rank_per_stage_gives_the_rank_by_rank_result_with_the_paper_recipes(plan: ClusterPlan) -> None:
    spec = cluster_spec("h100")  # with its stage-message overhead tasks
    every, stages = simulate_plan(SMALL, spec, plan, symmetric=False), simulate_plan(SMALL, spec, plan)
    assert stages.step_seconds == every.step_seconds
    assert [rank.peak_live_bytes for rank in stages.ranks] == [rank.peak_live_bytes for rank in every.ranks]


def test_interleaving_cuts_the_bubble_to_p_minus_1_over_v_m() -> None:
    free = load_spec("a100")
    free = replace(free, intra_node=Link(1e30, 0.0), inter_node=Link(1e30, 0.0), op_overhead_s=0.0)
    shape = replace(SMALL, layers=16, embeddings=False, global_batch=16)
    idle = {}
    for chunks in (1, 2, 4):
        result = simulate_plan(shape, free, ClusterPlan(dp=1, tp=1, pp=4, microbatch_size=1, virtual_stages=chunks))
        idle[chunks] = result.ranks[0].idle
        assert result.ranks[0].busy == pytest.approx(result.ranks[3].busy)  # the same work, in v chunks
    # 1F1B's bubble: (p - 1) of the m = 16 microbatches' forward and backward; interleaved, 1/v of it
    assert idle[1] / result.ranks[0].busy == pytest.approx(3 / 16, rel=0.1)
    assert idle[2] / idle[1] == pytest.approx(1 / 2, rel=1e-6) and idle[4] / idle[1] == pytest.approx(1 / 4, rel=1e-6)


def test_overlapping_the_gradient_reduction_and_tp_comm_shortens_the_step() -> None:
    spec = cluster_spec("h100")
    layout = {"dp": 4, "tp": 2, "pp": 1, "microbatch_size": 1, "zero1": True, "sequence_parallel": True}
    plain = simulate_plan(SMALL, spec, ClusterPlan(**layout)).step_seconds
    grads = simulate_plan(SMALL, spec, ClusterPlan(**layout, overlap_grad_reduce=True)).step_seconds
    both = simulate_plan(SMALL, spec, ClusterPlan(**layout, overlap_grad_reduce=True, overlap_tp_comm=True)).step_seconds
    assert both < grads < plain


def test_a_named_spec_prices_the_analytic_path_with_its_large_run_terms() -> None:
    kernel = load_spec("h100")
    assert kernel.matmul_efficiency == 0.75  # the kernel-level figure traced plans keep
    terms = large_run_terms("h100")
    assert terms is not None and "mean absolute error" in terms.calibration and "Llama 3" in terms.calibration
    priced = cluster_spec("h100")
    assert priced.name == kernel.name + SUFFIX and priced.matmul_efficiency == terms.matmul_efficiency
    assert large_run_terms(priced) == terms and cluster_spec(priced) == priced
    assert large_run_terms("v100") is None and cluster_spec("v100") == load_spec("v100")
    assert cluster_spec("h100", large_run=False) == kernel
    assert large_run_terms("h200") is not None  # the H100's, stated so
    assert LargeRunTerms(0.5, 0.0, 0.0).apply(priced).matmul_efficiency == 0.5


def test_each_outcome_states_what_it_assumed() -> None:
    plan = ClusterPlan(dp=2, tp=2, pp=4, microbatch_size=1, overlap_grad_reduce=True)
    outcome = evaluate(SMALL, cluster_spec("a100"), plan, float("inf"))
    assert "A100-SXM4-80GB (large-run terms): matmuls at" in outcome.basis
    assert "gradient reduction overlapped" in outcome.basis and "mean absolute error" in outcome.basis
    assert "not calibrated" in evaluate(SMALL, load_spec("a100"), ClusterPlan(dp=2, tp=2, pp=4, microbatch_size=1), float("inf")).basis


def test_the_search_tries_interleaving_and_prunes_dominated_recipes() -> None:
    plans = cluster_plans(SMALL, 8, 8, virtual_stages=(1, 2), prune=True)
    assert {plan.virtual_stages for plan in plans if plan.pp == 4} == {1, 2}
    assert all(plan.virtual_stages == 1 for plan in plans if plan.pp == 1)
    assert all(plan.zero1 for plan in plans if plan.dp > 1) and all(plan.sequence_parallel for plan in plans if plan.tp > 1)
    full, _ = search_cluster(SMALL, "a100", 8, virtual_stages=(1, 2))
    pruned, _ = search_cluster(SMALL, "a100", 8, virtual_stages=(1, 2), prune=True)
    assert len(pruned) < len(full) and pruned[0].step_seconds == pytest.approx(full[0].step_seconds, rel=0.02)


def test_a_recipe_refuses_no_chunks() -> None:
    with pytest.raises(ValueError, match="virtual_stages"):
        Recipe(virtual_stages=0)
    assert "interleaved × 2" in str(ClusterPlan(dp=1, tp=1, pp=4, microbatch_size=1, virtual_stages=2, overlap_grad_reduce=True))


def test_the_shipped_terms_predict_the_published_runs_within_the_goal() -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from paper_scale_data import RUNS
        from simulator_paper_scale import shape_and_plan
    finally:
        sys.path.remove(str(BENCHMARKS))
    errors: dict[str, list[float]] = {}
    for run in RUNS:
        shape, plan = shape_and_plan(run)
        seconds = simulate_plan(shape, cluster_spec(run.gpu), plan).step_seconds
        errors.setdefault(run.gpu, []).append(run.published_step_seconds() / seconds - 1)
    for gpu, found in errors.items():
        assert sum(map(abs, found)) / len(found) <= 0.10, gpu
        assert max(map(abs, found)) <= 0.2, gpu


def test_the_plan_command_plans_a_paper_shape_analytically(capsys: pytest.CaptureFixture) -> None:
    from lightning_nnscaler.app.config import ConfigError
    from lightning_nnscaler.app.plan_command import analytic_plan_command

    best = analytic_plan_command(["analytic=gpt3-6.7b", "spec=h100", "world_size=32", "layers=8", "global_batch=64", "virtual_stages=1,2"])
    printed = capsys.readouterr().out
    assert f"chosen: {best.plan}" in printed and "predicted step" in printed and "GB per GPU" in printed
    assert "assumed: H100-SXM5-80GB (large-run terms)" in printed and "mean absolute error" in printed
    with pytest.raises(ConfigError, match="analytic="):
        analytic_plan_command(["analytic=gpt5", "world_size=8"])
