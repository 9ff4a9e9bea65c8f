"""Stage cuts priced by measured op times (``balance="measured"``): the cut follows the prices it is given, every
rank cuts alike, and a request that cannot be priced is refused naming the key."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.ir.op import Op
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.plans.catalog import apply_recipe
from lightning_nnscaler.plans.stage_cuts import cut_stages, op_cost
from lightning_nnscaler.sim.profile import ProfileDB, device_tag, measured_prices


def gpt_and_batch() -> tuple[GPT, object]:
    torch.manual_seed(0)
    model = GPT(GPTConfig.small())
    return model, model.example_batch(8, torch.Generator().manual_seed(0))


def heavy_loss(ops: Sequence[Op]) -> list[float]:
    """The estimate's prices, but the loss and the head 40 times dearer (as a large vocabulary's softmax is on a CPU)."""
    return [op_cost(op) * (40.0 if "lm_head" in str(op) or "cross_entropy" in op.target else 1.0) for op in ops]


def stage_prices(graph, stage_of: dict[str, int], stages: int, prices) -> list[float]:
    ops = [op for op in graph.ops if stage_of[op.name] >= 0]
    costs = dict(zip((op.name for op in ops), prices(ops), strict=True))
    return [sum(cost for name, cost in costs.items() if stage_of[name] == stage) for stage in range(stages)]


def test_a_cut_by_measured_prices_balances_those_prices_where_the_estimate_does_not() -> None:
    model, batch = gpt_and_batch()
    graph = lnn.trace(model, batch, step="training_step")
    estimated = cut_stages(graph, 2).stage_of
    measured = cut_stages(graph, 2, prices=heavy_loss).stage_of
    spread = {name: max(costs) / min(costs) for name, cut in (("estimate", estimated), ("measured", measured))
              for costs in [stage_prices(graph, cut, 2, heavy_loss)]}
    assert spread["measured"] < spread["estimate"], spread
    assert sum(stage == 1 for stage in measured.values()) < sum(stage == 1 for stage in estimated.values())


def test_parallelize_cuts_by_the_prices_given_and_the_plan_equals_one_device() -> None:
    model, batch = gpt_and_batch()
    plan = lnn.parallelize(model, batch, "1f1b", 2, step="training_step", microbatches=2, balance="measured", measured_prices=heavy_loss)
    estimate = lnn.parallelize(model, batch, "1f1b", 2, step="training_step", microbatches=2)
    first_stage = lambda planned: sum(op.segment is not None and op.segment[0] == 0 for op in planned.ops)  # noqa: E731
    assert first_stage(plan.planned) > first_stage(estimate.planned)
    plan.verify()


def test_parallelize_times_the_ops_on_the_device_and_keeps_the_times(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LNN_PROFILE_CACHE", str(tmp_path))
    model, batch = gpt_and_batch()
    plan = lnn.parallelize(model, batch, "gpipe", 2, step="training_step", microbatches=2, balance="measured")
    plan.verify()
    database = ProfileDB.open("cpu")
    assert database.path == tmp_path / f"{device_tag('cpu')}.json" and len(database.entries) > 10
    ops = list(lnn.trace(model, batch, step="training_step").ops)
    prices = measured_prices("cpu")(ops)
    assert all(price >= 0 for price in prices) and max(prices) > 0
    kept = ProfileDB.open("cpu").entries
    assert len(kept) >= len(database.entries)
    assert measured_prices("cpu")(ops) == prices and ProfileDB.open("cpu").entries == kept  # timed once, then read back


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"balance": "flops"}, r"balance must be one of \('estimate', 'measured'\), got 'flops'"),
        ({"balance": "measured", "layers_per_stage": [1, 1]}, r"balance='measured' prices a cut by cost; layers_per_stage fixes the cut"),
        ({"balance": "measured"}, r"balance='measured' needs op times measured on the run's device"),
    ],
)
def test_a_balance_that_cannot_be_priced_is_refused_naming_the_key(params: dict, message: str) -> None:
    model, batch = gpt_and_batch()
    graph = lnn.trace(model, batch, step="training_step")
    with pytest.raises(ValueError, match=message):
        apply_recipe(graph, "1f1b", 2, microbatches=2, **params)


@pytest.mark.parametrize("recipe", ["gpipe", "1f1b", "zb1", "interleaved", "3f1b", "interlaced", "hybrid3d", "zbv", "vhalf", "dualpipev"])
def test_every_pipeline_recipe_takes_balance(recipe: str) -> None:
    from lightning_nnscaler.plans.catalog import load_recipe

    assert load_recipe(recipe).parameters["balance"].default == "estimate"


def test_every_rank_cuts_by_rank_zeros_times_and_later_plans_keep_them(tmp_path, monkeypatch) -> None:
    """The strategy's pricing (``strategy.planning.rank_zero_prices``): rank 1 measures nothing and takes rank 0's times;
    an op priced once keeps its price (an evaluation step, a batch of other rows cut where training did)."""
    from types import SimpleNamespace

    from lightning_nnscaler.strategy.planning import rank_zero_prices

    monkeypatch.setenv("LNN_PROFILE_CACHE", str(tmp_path))
    model, batch = gpt_and_batch()
    ops = list(lnn.trace(model, batch, step="training_step").ops)[:6]
    rank0, known0 = SimpleNamespace(device=torch.device("cpu"), global_rank=0), {}
    sent = []
    prices0 = rank_zero_prices(rank0, lambda value: sent.append(value) or [value, (None, None)], known0)(ops)
    assert sent[0][0] == prices0 and sent[0][1] is None and len(prices0) == len(ops)
    known1 = {}
    rank1 = SimpleNamespace(device=torch.device("cpu"), global_rank=1)
    assert rank_zero_prices(rank1, lambda value: [(prices0, None), value], known1)(ops) == prices0 == [known1[op.name] for op in ops]
    assert rank_zero_prices(rank1, lambda value: [(None, None), value], known1)(ops) == prices0  # nothing new to time
    with pytest.raises(RuntimeError, match="rank 0 could not time the model's ops: OSError: disk gone"):
        rank_zero_prices(rank1, lambda value: [(None, "OSError: disk gone"), value], {})(ops)


def test_explain_shows_each_stages_share_of_the_work_its_cut_balanced() -> None:
    model, batch = gpt_and_batch()
    estimate = lnn.parallelize(model, batch, "1f1b", 2, step="training_step", microbatches=2)
    measured = lnn.parallelize(
        model, batch, "1f1b", 2, step="training_step", microbatches=2, balance="measured", measured_prices=heavy_loss
    )
    for plan, priced in ((estimate, "work estimated from shapes"), (measured, "op times measured on the device")):
        line = next(line for line in plan.explain().splitlines() if line.startswith("stage work"))
        shares = [share for _, share in plan.pipeline.stage_work]
        assert line.startswith(f"stage work ({priced}): 0: {shares[0]:.3f} / 1: {shares[1]:.3f}; the slowest stage "), line
        assert sum(shares) == pytest.approx(1.0) and f"{2 * max(shares):.2f}x the mean" in line
    graph = lnn.trace(model, batch, step="training_step")
    priced = stage_prices(graph, cut_stages(graph, 2, prices=heavy_loss).stage_of, 2, heavy_loss)
    expected = [cost / sum(priced) for cost in priced]  # the helper also counts the weights-only ops the cut does not price
    assert [share for _, share in measured.pipeline.stage_work] == pytest.approx(expected, rel=1e-3)


def test_an_interlaced_pipeline_reports_its_cut_stages_by_number() -> None:
    from lightning_nnscaler.models.mbart import MBart, MBartConfig

    torch.manual_seed(0)
    model = MBart(MBartConfig.small())
    plan = lnn.parallelize(model, model.example_batch(4, torch.Generator().manual_seed(0)), "interlaced", 2, step="training_step")
    assert [stage for stage, _ in plan.pipeline.stage_work] == [1, 2]  # stages 0 and 3 are the shared vocabulary layers
