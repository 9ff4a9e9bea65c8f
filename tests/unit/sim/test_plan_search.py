"""Plan search (``sim.search``) and the ``auto`` recipe on a small GPT: ranking, the memory limit, the
families searched, the applied winner (checked by ``verify``) and the errors that name their key."""

from __future__ import annotations

import pytest
import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.capture.trace import trace_step
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.sim.search import FAMILIES, candidates, search


@pytest.fixture(scope="module")
def gpt_and_batch():
    torch.manual_seed(0)
    model = GPT(GPTConfig.small())  # 4 heads, 2 layers
    model.log = lambda *args, **kwargs: None
    return model, model.example_batch(8, torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def graph(gpt_and_batch):
    model, batch = gpt_and_batch
    return trace_step(model, batch).graph


@pytest.fixture(scope="module")
def searched(graph):
    return search(graph, 4, spec="cpu", recipes="dp,zero3,tp,hybrid,1f1b,zb1")


def test_the_ranked_table_is_sorted_by_predicted_time(searched) -> None:
    times = [outcome.step_seconds for outcome in searched.ranked]
    assert len(times) >= 4 and times == sorted(times)
    assert searched.best is searched.ranked[0]
    rows = searched.table().splitlines()[1:]
    assert [row.split()[1] for row in rows[: len(times)]] == [outcome.candidate.recipe for outcome in searched.ranked]


def test_candidates_over_the_memory_limit_are_excluded_with_the_reason(graph, searched) -> None:
    peaks = sorted(outcome.peak_bytes for outcome in searched.ranked)
    limit = (peaks[0] + peaks[-1]) / 2
    limited = search(graph, 4, spec="cpu", recipes="dp,zero3,tp,hybrid,1f1b,zb1", memory_limit_gb=limit / 1e9)
    assert limited.ranked and all(outcome.peak_bytes <= limit for outcome in limited.ranked)
    over = [outcome for outcome in limited.rejected if outcome.peak_bytes is not None]
    assert over and all(outcome.peak_bytes > limit and "over the" in outcome.reason and "limit" in outcome.reason for outcome in over)
    assert limited.best.peak_bytes <= limit


def test_no_candidate_fitting_raises_with_the_reasons(graph) -> None:
    nothing_fits = search(graph, 2, spec="cpu", recipes="dp", memory_limit_gb=1e-6)
    with pytest.raises(ValueError, match=r"no candidate plan fits 2 ranks.*dp: peak .* over the 1000 B limit.*memory_limit_gb"):
        nothing_fits.best


def test_a_restricted_recipes_list_is_honoured(graph) -> None:
    result = search(graph, 4, spec="cpu", recipes=["zero3", "dp"])
    assert {outcome.candidate.recipe for outcome in result.outcomes} == {"dp", "zero3"}


def test_candidates_cover_the_degrees_and_respect_max_pp() -> None:
    found = {str(candidate) for candidate in candidates(4, 8, FAMILIES, max_pp=2)}
    assert {"tp degree=2", "tp degree=4", "hybrid dp=2 tp=2", "coshard shards=2 recompute=False", "1f1b stages=2 microbatches=2",
            "interleaved stages=2 microbatches=2 virtual_stages=2", "hybrid3d dp=1 tp=2 pp=2 microbatches=2"} <= found
    assert not [name for name in found if "stages=4" in name or "pp=4" in name]


def test_1f1b_zb1_and_hybrid3d_are_also_candidates_recomputing_then_co_sharding_the_first_stage_and_every_stage() -> None:
    found = [str(candidate) for candidate in candidates(4, 8, ("1f1b", "zb1", "hybrid3d", "gpipe"), max_pp=2)]
    start = found.index("1f1b stages=2 microbatches=2")
    plain = "1f1b stages=2 microbatches=2"
    assert found[start:start + 5] == [plain, f"{plain} recompute_stages=0", f"{plain} recompute_stages=0,1",
                                      f"{plain} coshard_stages=0 shards=2", f"{plain} coshard_stages=0,1 shards=2"]
    assert "hybrid3d dp=1 tp=2 pp=2 microbatches=2 recompute_stages=0" in found and "zb1 stages=2 microbatches=4 recompute_stages=0,1" in found
    assert not [name for name in found if name.startswith("gpipe") and ("recompute" in name or "coshard" in name)]


def test_under_a_memory_limit_the_search_recomputes_the_first_stage_only_when_that_fits(gpt_and_batch, graph) -> None:
    families = {"recipes": "1f1b", "max_pp": 2}
    everything = search(graph, 4, spec="cpu", memory_limit_gb=1e-9, **families)  # nothing fits: every variant is built
    outcome = {str(outcome.candidate): outcome for outcome in everything.outcomes}
    plain = outcome["1f1b stages=2 microbatches=2"]
    first, every = outcome[f"{plain.candidate} recompute_stages=0"], outcome[f"{plain.candidate} recompute_stages=0,1"]
    assert every.peak_bytes < first.peak_bytes < plain.peak_bytes and plain.step_seconds < first.step_seconds < every.step_seconds
    limit = first.peak_bytes * 1.01  # between recomputing every stage and none (1 %: auto traces the step itself, a few bytes apart)
    assert limit < plain.peak_bytes
    limited = search(graph, 4, spec="cpu", memory_limit_gb=limit / 1e9, **families)
    assert limited.best.candidate == first.candidate
    chosen = {str(outcome.candidate): outcome for outcome in limited.outcomes}
    assert chosen[str(plain.candidate)].reason.startswith("peak") and not chosen[str(plain.candidate)].fits
    assert chosen[str(every.candidate)].reason.startswith(f"not built: {first.candidate} fits the limit saving less memory")
    assert every.step_seconds > limited.best.step_seconds and every.peak_bytes <= limit  # it would fit, and is slower
    model, batch = gpt_and_batch
    plan = lnn.parallelize(model, batch, "auto", 4, step="training_step", spec="cpu", memory_limit_gb=limit / 1e9, **families)
    assert plan.search.best.candidate == first.candidate
    assert ["= checkpoint(" in source for source in plan.sources] == [True, False, True, False]  # stage 0 of both replicas
    plan.verify()


def test_cannot_build_is_a_reason_not_an_error(graph) -> None:
    result = search(graph, 4, spec="cpu", recipes="3f1b")  # GPT has no recycling passes
    assert not result.ranked and all(outcome.reason.startswith("cannot build: 3f1b:") for outcome in result.rejected)


def test_auto_applies_the_winner_which_verifies_and_explains_itself(gpt_and_batch, one_thread) -> None:
    model, batch = gpt_and_batch
    plan = lnn.parallelize(model, batch, "auto", 4, step="training_step", recipes="dp,tp,hybrid,1f1b")
    assert plan.recipe == "auto" and plan.search is not None
    winner = plan.search.best
    assert plan.zero_stage == winner.built.zero_stage and (plan.pipeline is None) == (winner.built.pipeline is None)
    assert plan.data_layout == winner.built.layout  # each rank's code reads the winner's replica's rows
    assert lnn.load_recipe("auto").layout(4, {}).data_parallel == 4  # while the DataLoader loads ddp's rows per rank
    plan.verify()
    text = plan.explain()
    assert f"searched: {winner.candidate} — predicted" in text and str(winner.candidate) in text.split("searched:")[1].splitlines()[2]


def test_auto_searches_every_family_by_default(gpt_and_batch) -> None:
    model, batch = gpt_and_batch
    plan = lnn.parallelize(model, batch, "auto", 2, step="training_step", spec="a100")
    two_axes = {"hybrid", "hybrid3d"}  # need two degrees above 1: at least 4 ranks
    assert {outcome.candidate.recipe for outcome in plan.search.outcomes} == set(FAMILIES) - two_axes
    assert plan.search.spec_name.startswith("A100")


@pytest.mark.parametrize(("params", "message"), [
    ({"recipes": "dp,megatron"}, r"auto: recipes='dp,megatron' names 'megatron'; the searchable recipes are dp, zero1"),
    ({"recipes": ""}, r"auto: recipes='' names no recipe"),
    ({"memory_limit_gb": -1.0}, r"auto: memory_limit_gb must be a positive number of GB .* got -1.0"),
    ({"max_pp": 0}, r"recipe 'auto': parameter 'max_pp' is 0; it must be int >= 1"),
    ({"spec": "tpu9"}, r"auto: spec='tpu9': no hardware spec 'tpu9'"),
])
def test_a_bad_parameter_names_its_key(gpt_and_batch, params: dict, message: str) -> None:
    model, batch = gpt_and_batch
    with pytest.raises(ValueError, match=message):
        lnn.parallelize(model, batch, "auto", 2, step="training_step", **params)


def test_the_catalog_types_the_parameters(gpt_and_batch) -> None:
    model, batch = gpt_and_batch
    with pytest.raises(lnn.RecipeError, match=r"recipe 'auto': parameter 'recipes' expects str, got list"):
        lnn.parallelize(model, batch, "auto", 2, step="training_step", recipes=["dp"])


def test_when_recomputing_every_stage_is_over_the_limit_the_search_co_shards_them(graph) -> None:
    families = {"recipes": "hybrid3d", "max_pp": 2}
    everything = search(graph, 4, spec="cpu", memory_limit_gb=1e-9, **families)  # nothing fits: every variant is built
    outcome = {str(outcome.candidate): outcome for outcome in everything.outcomes}
    plain = "hybrid3d dp=1 tp=2 pp=2 microbatches=4"
    recomputed, co_sharded = outcome[f"{plain} recompute_stages=0,1"], outcome[f"{plain} coshard_stages=0,1 shards=2"]
    # a recomputed segment's backward holds all its activations again; a co-sharded one, one piece's at a time
    assert co_sharded.peak_bytes < recomputed.peak_bytes and co_sharded.step_seconds > recomputed.step_seconds
    limit = (co_sharded.peak_bytes + recomputed.peak_bytes) / 2
    limited = search(graph, 4, spec="cpu", memory_limit_gb=limit / 1e9, **families)
    assert limited.best.candidate.chain == "coshard" and limited.best.peak_bytes <= limit
    chosen = {str(outcome.candidate): outcome for outcome in limited.outcomes}
    assert not chosen[plain].fits and not chosen[f"{plain} recompute_stages=0,1"].fits and chosen[f"{plain} coshard_stages=0,1 shards=2"].fits
