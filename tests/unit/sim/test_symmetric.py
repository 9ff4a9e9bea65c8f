"""``sim.symmetric``: one simulated rank per pipeline stage stands for its replicas and tp peers."""

from __future__ import annotations

import pytest

from lightning_nnscaler.sim import load_spec
from lightning_nnscaler.sim.analytic import TransformerShape, transformer_task_lists
from lightning_nnscaler.sim.cluster import ClusterPlan, evaluate, simulate_plan
from lightning_nnscaler.sim.symmetric import StandIn, symmetric_layout

SMALL = TransformerShape(layers=8, hidden=1024, seq_len=512, vocab=1000, heads=8, global_batch=32, embeddings=True)
WIDE = TransformerShape(layers=16, hidden=2048, seq_len=1024, vocab=50257, heads=16, global_batch=64)


@pytest.mark.parametrize(("shape", "plan"), [
    (SMALL, ClusterPlan(dp=2, tp=2, pp=4, microbatch_size=1)),
    (SMALL, ClusterPlan(dp=1, tp=1, pp=4, microbatch_size=2)),
    (SMALL, ClusterPlan(dp=8, tp=1, pp=1, microbatch_size=1)),
    (WIDE, ClusterPlan(dp=4, tp=8, pp=8, microbatch_size=1)),  # 256 ranks: tp fills a node, stages and replicas across nodes
    (WIDE, ClusterPlan(dp=2, tp=4, pp=16, microbatch_size=2)),
], ids=["dp2-tp2-pp4", "pp4-mb2", "dp8", "dp4-tp8-pp8", "dp2-tp4-pp16"])
def test_one_rank_per_stage_gives_the_rank_by_rank_result(shape: TransformerShape, plan: ClusterPlan) -> None:
    spec = load_spec("a100")
    assert symmetric_layout(spec.ranks_per_node, dp=plan.dp, tp=plan.tp, pp=plan.pp)
    every = simulate_plan(shape, spec, plan, symmetric=False)
    stages = simulate_plan(shape, spec, plan)
    assert len(stages.ranks) == len(every.ranks) == plan.dp * plan.tp * plan.pp
    assert stages.step_seconds == every.step_seconds  # exactly: the same operations in the same order
    for mine, theirs in zip(stages.ranks, every.ranks, strict=True):
        assert (mine.end, mine.communication) == (theirs.end, theirs.communication)
        assert (mine.peak_activation_bytes, mine.peak_live_bytes, mine.sent_bytes) == (
            theirs.peak_activation_bytes, theirs.peak_live_bytes, theirs.sent_bytes)
        # busy is summed in a different grouping (a rank that waits for its tp peers adds its compute in more pieces)
        assert (mine.busy, mine.idle) == pytest.approx((theirs.busy, theirs.idle), rel=1e-12, abs=1e-15)
    assert stages.bubble_fraction == pytest.approx(every.bubble_fraction, rel=1e-12)
    assert evaluate(shape, spec, plan, float("inf")).peak_bytes == evaluate(shape, spec, plan, float("inf"), symmetric=False).peak_bytes


def test_the_symmetric_lists_do_not_grow_with_dp_or_tp() -> None:
    spec = load_spec("a100")
    sizes = [(1, 1, 16), (2, 2, 32), (4, 8, 64), (128, 8, 2048)]  # (dp, tp, global batch): 16 microbatches each
    counts = []
    for dp, tp, batch in sizes:
        shape = TransformerShape(layers=8, hidden=1024, seq_len=512, heads=8, global_batch=batch)
        lists = transformer_task_lists(shape, spec, dp=dp, tp=tp, pp=4, representatives=True)
        assert len(lists) == 4
        counts.append(sum(map(len, lists)))
    assert len(set(counts)) == 1
    assert counts[0] < 4 * 16 * 10  # O(pp × microbatches)


def test_an_asymmetric_layout_is_simulated_rank_by_rank() -> None:
    spec = load_spec("a100")  # 8 ranks per node
    # tp 4 × pp 3: stage 0 → 1 is inside a node for replica 0 (ranks 0 → 4) and across nodes for replica 1 (12 → 16)
    assert not symmetric_layout(spec.ranks_per_node, dp=2, tp=4, pp=3)
    assert symmetric_layout(spec.ranks_per_node, dp=2, tp=4, pp=4)
    shape = TransformerShape(layers=6, hidden=512, seq_len=256, heads=8, global_batch=8)
    plan = ClusterPlan(dp=2, tp=4, pp=3, microbatch_size=1)
    assert simulate_plan(shape, spec, plan).step_seconds == simulate_plan(shape, spec, plan, symmetric=False).step_seconds
    with pytest.raises(ValueError, match="not symmetric"):
        simulate_plan(shape, spec, plan, symmetric=True)


def test_a_stand_in_group_is_its_whole_group_for_equality() -> None:
    tp, dp = StandIn(0, (0, 1)), StandIn(0, (0, 4))
    assert len(tp) == 1 and list(tp) == [0]
    assert tp != dp and tp == StandIn(0, (0, 1)) and len({tp, dp, StandIn(0, (0, 1))}) == 2
