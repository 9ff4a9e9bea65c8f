"""No silent weaker plan: a recipe that cannot split what it means to raises (or, with allow_partial, warns), and no rank idles."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir.validate import IdleRankError
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.plans import PlanContext, RecipeError
from lightning_nnscaler.plans import catalog
from lightning_nnscaler.plans.catalog import register_recipe
from lightning_nnscaler.plans.coverage import PartialPlanWarning, check_coverage
from lightning_nnscaler.plans.propagate import recording_refusals

ATTENTION_REFUSED = (
    "attention modules blocks.0.attn, blocks.1.attn (4 heads, which 3 parts do not divide): "
    "q_proj, k_proj, v_proj, out_proj by dim 'n' (out features) of size 32 (3 parts)"
)


def test_tp_over_3_ranks_of_4_heads_is_refused_naming_attention_ffn_and_parts(gpt_model) -> None:
    model, batch = gpt_model
    assert (model.config.heads, model.config.hidden, model.config.ffn_hidden) == (4, 32, 128)  # 3 divides none
    with pytest.raises(RecipeError) as caught:
        lnn.parallelize(model, batch, "tp", 3, step="training_step")
    message = str(caught.value)
    assert message.startswith("recipe 'tp' over 3 ranks split 0% of the parameter elements; left whole (replicated)")
    assert ATTENTION_REFUSED in message
    assert "modules blocks.0.mlp, blocks.1.mlp: fc1 by dim 'n' (out features) of size 128 (3 parts)" in message
    assert "so that its parts (now 3) divide 4, 32 and 128; or pass allow_partial=True" in message


def test_allow_partial_warns_with_the_split_fraction_and_verifies(gpt_model) -> None:
    model, batch = gpt_model
    with pytest.warns(PartialPlanWarning, match=r"recipe 'tp' over 3 ranks split 0% of the parameter elements") as caught:
        plan = lnn.parallelize(model, batch, "tp", 3, step="training_step", allow_partial=True)
    assert ATTENTION_REFUSED in str(caught[0].message)
    assert plan.verify().world_size == 3  # the weaker plan is still the model's step


def test_allow_partial_reports_what_was_split_when_only_the_heads_do_not_divide() -> None:
    """Hidden 48 and FFN 192 divide into 3, 4 heads do not: q/k/v and the FFN split, the head views stay whole."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, seq_len=16, hidden=48, layers=1, heads=4))
    batch = model.example_batch(2, torch.Generator().manual_seed(1))
    with pytest.warns(PartialPlanWarning) as caught:
        plan = lnn.parallelize(model, batch, "tp", 3, step="training_step", allow_partial=True)
    message = str(caught[0].message)
    fraction = int(re.search(r"split (\d+)% of the parameter elements", message).group(1))
    assert 0 < fraction < 100
    assert (
        "attention module blocks.0.attn (4 heads, which 3 parts do not divide): "
        "view after q_proj, view after k_proj, view after v_proj by dim 'c' of size 4 (3 parts)"
    ) in message
    assert "mlp" not in message  # the FFN was split
    plan.verify()


@pytest.mark.parametrize("world_size", [2, 4])
def test_tp_whose_parts_divide_passes_without_a_warning(gpt_model, world_size: int) -> None:
    model, batch = gpt_model
    with warnings.catch_warnings():
        warnings.simplefilter("error", PartialPlanWarning)
        plan = lnn.parallelize(model, batch, "tp", world_size, step="training_step")
    assert plan.planned.devices == list(range(world_size))


def test_the_report_names_split_and_replicated_parameters(gpt) -> None:
    with recording_refusals() as refusals:
        plan, _ = gpt.plan("tp", 2)
    report = check_coverage(plan, gpt.graph, 2, recipe="tp", refusals=refusals)
    assert report.complete and refusals == []
    split = {parameter.key: parameter.split for parameter in report.parameters}
    assert split["blocks.0.attn.q_proj.weight"] and split["blocks.0.attn.out_proj.weight"] and split["blocks.1.mlp.fc1.bias"]
    assert not split["blocks.0.attn.out_proj.bias"]  # a row-split linear's bias is value-split: whole on every rank
    assert not any(split[key] for key in ("token_embedding.weight", "blocks.0.ln_1.weight", "lm_head.weight"))
    assert 0.5 < report.split_fraction < 1.0
    assert report.summary() == "recipe 'tp' over 2 ranks split 73% of the parameter elements; it left nothing whole that it meant to split"


def test_dp_splits_no_parameter_and_is_complete(gpt) -> None:
    with recording_refusals() as refusals:
        plan, _ = gpt.plan("dp", 4)
    report = check_coverage(plan, gpt.graph, 4, recipe="dp", refusals=refusals)
    assert report.complete and report.split_fraction == 0.0  # dp means to split the batch only


def test_coshard_whose_pieces_do_not_divide_the_heads_is_refused(gpt_model) -> None:
    model, batch = gpt_model
    message = (
        r"attention modules blocks.0.attn, blocks.1.attn \(4 heads, which 8 parts do not divide\): "
        r"view after q_proj, view after k_proj, view after v_proj by dim 'c' of size 4 \(8 parts\)"
    )
    with pytest.raises(RecipeError, match=message):
        lnn.parallelize(model, batch, "coshard", 2, step="training_step")  # shards=4 by default: 8 pieces of 4 heads


def test_hybrid_names_a_refusal_of_every_replica_once(gpt) -> None:
    with recording_refusals() as refusals:
        plan, _ = gpt.plan("hybrid", 6, dp=2, tp=3)
    assert len(refusals) == 2 * 12  # 6 linears per block, 2 blocks, in each of the 2 replicas
    with pytest.raises(RecipeError) as caught:
        check_coverage(plan, gpt.graph, 6, recipe="hybrid", refusals=refusals)
    assert str(caught.value).count(ATTENTION_REFUSED) == 1


def test_a_hand_made_plan_leaving_a_rank_idle_is_refused(gpt_model) -> None:
    model, batch = gpt_model
    graph = lnn.trace(model, batch, step="training_step")
    planned = graph.copy()
    for op in planned.ops:
        lnn.op_assign(planned, op, 0)
    with pytest.raises(IdleRankError, match=r"rank 1 of world_size 2 runs no op: the plan uses only 1 of its 2 ranks.*Plan for world_size 1"):
        lnn.build_plan(model, batch, "training_step", graph, planned, 2)
    assert lnn.build_plan(model, batch, "training_step", graph, planned, 1).world_size == 1


def everything_on_device_zero(graph: Graph, ctx: PlanContext) -> None:
    """A user's recipe that forgets the other ranks."""
    for op in graph.ops:
        lnn.op_assign(graph, op, 0)


def test_a_recipe_leaving_ranks_idle_is_refused_even_with_allow_partial(gpt_model, monkeypatch) -> None:
    model, batch = gpt_model
    lnn.list_recipes()  # the built-ins are read; the registration below is undone after the test
    monkeypatch.setattr(catalog, "_REGISTRY", dict(catalog._REGISTRY))
    register_recipe(everything_on_device_zero)
    with pytest.raises(IdleRankError, match=r"ranks 1, 2, 3 of world_size 4 run no op"):
        lnn.parallelize(model, batch, "everything_on_device_zero", 4, step="training_step", allow_partial=True)


def test_a_model_parallel_recipe_that_splits_nothing_is_refused() -> None:
    """tp over a conv-only model: each rank would repeat the whole step; refused instead of silently replicated."""

    class ConvOnly(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = torch.nn.Conv1d(3, 8, 3, padding=1), torch.nn.Conv1d(8, 4, 3, padding=1)

        def forward(self, signal: torch.Tensor) -> torch.Tensor:
            return self.second(torch.relu(self.first(signal))).square().mean()

    with pytest.raises(RecipeError, match=r"recipe 'tp' over 2 ranks \(2 per data-parallel replica\) split nothing: every rank would run every op whole.*Use dp or zero3"):
        lnn.parallelize(ConvOnly(), (torch.randn(4, 3, 16),), "tp", 2)
    lnn.parallelize(ConvOnly(), (torch.randn(4, 3, 16),), "dp", 2).verify()
