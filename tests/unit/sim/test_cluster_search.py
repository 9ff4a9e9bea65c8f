"""``sim.cluster``: dp × tp × pp plans of a transformer shape searched on a spec's hypothetical cluster."""

from __future__ import annotations

from lightning_nnscaler.sim import CommModel, Machine, load_spec, simulate
from lightning_nnscaler.sim.analytic import TransformerShape, transformer_task_lists
from lightning_nnscaler.sim.cluster import BYTES_PER_PARAMETER, ClusterPlan, evaluate, search_cluster

SHAPE = TransformerShape(layers=4, hidden=512, seq_len=256, vocab=1000, heads=8, global_batch=32, embeddings=True)


def test_the_fitting_plans_come_fastest_first_and_the_others_say_why() -> None:
    outcomes, seconds = search_cluster(SHAPE, "a100", 8, memory_limit_gb=0.2)
    fitting = [outcome for outcome in outcomes if not outcome.reason]
    over = [outcome for outcome in outcomes if outcome.reason]
    assert fitting and over and seconds < 30
    assert outcomes[: len(fitting)] == fitting
    assert [outcome.step_seconds for outcome in fitting] == sorted(outcome.step_seconds for outcome in fitting)
    assert all(outcome.peak_bytes <= 0.2e9 for outcome in fitting)
    assert all("over the" in outcome.reason and outcome.peak_bytes > 0.2e9 for outcome in over)


def test_a_pipelined_plans_peak_counts_the_message_copies_its_ranks_hold() -> None:
    spec = load_spec("a100")
    plan = ClusterPlan(dp=1, tp=1, pp=4, microbatch_size=1)
    stats = simulate(transformer_task_lists(SHAPE, spec, dp=1, tp=1, pp=4), CommModel(spec), Machine(spec.ranks_per_node)).ranks
    first, last = stats[0], stats[-1]
    assert first.peak_live_bytes > first.peak_activation_bytes  # the activations it sent, until their gradients come back
    assert first.sent_bytes == 0  # every one came back
    activation = SHAPE.microbatch_size * SHAPE.seq_len * SHAPE.hidden * SHAPE.dtype_bytes
    # a gradient sent back is dropped once the stage before sends an activation after taking it (materialize.releases):
    # in 1F1B that stage answers B(m) with F(m + 2), so only the last two gradients are held to the step's end
    assert last.sent_bytes == 2 * activation
    peaks = [BYTES_PER_PARAMETER * SHAPE.stage_parameters(stage, 4) + rank.peak_live_bytes for stage, rank in enumerate(stats)]
    assert evaluate(SHAPE, spec, plan, float("inf")).peak_bytes == max(peaks)
