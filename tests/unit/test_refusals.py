"""Bad inputs refused as ddp refuses them, at setup, before any rank waits in a collective, each naming
the key, its value and what is allowed (issue 34): counts of 0 or below for the recipes' parameters, a
collective timeout of 0 or below, and batches too small for the parts they are split into.

``CASES`` is shared with ``benchmarks/bad_inputs.py``, whose table counts them (none may pass silently).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.plans import RecipeError, list_recipes, load_recipe
from lightning_nnscaler.plans import catalog
from lightning_nnscaler.plans.catalog import register_recipe
from lightning_nnscaler.plans.dp import dp


@functools.lru_cache(maxsize=None)
def _gpt() -> Any:
    from lightning_nnscaler.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig.small())


def _plan(rows: int, recipe: str, world_size: int, **params: Any) -> Callable[[], Any]:
    """Plan GPTConfig.small()'s training_step on a batch of ``rows`` rows."""

    def run() -> Any:
        model = _gpt()
        batch = model.example_batch(rows, torch.Generator().manual_seed(1))
        return lnn.parallelize(model, batch, recipe, world_size, step="training_step", **params)

    return run


def _parameters(recipe: str, **params: Any) -> Callable[[], None]:
    return lambda: load_recipe(recipe).check_parameters(params)


def _hydra(recipe: str, **params: Any) -> Callable[[], Any]:
    from lightning_nnscaler.app.config import _recipe

    return lambda: _recipe({"name": recipe, "params": params})


def _strategy(**arguments: Any) -> Callable[[], Any]:
    return lambda: lnn.NnScalerStrategy(**arguments)


# name -> (what runs, the exception it must raise, a pattern its message must match)
CASES: dict[str, tuple[Callable[[], Any], type[BaseException], str]] = {
    "1f1b stages=0": (_parameters("1f1b", stages=0), RecipeError, r"recipe '1f1b': parameter 'stages' is 0; it must be int >= 1, or None"),
    "1f1b microbatches=0": (
        _parameters("1f1b", microbatches=0), RecipeError, r"parameter 'microbatches' is 0; it must be int >= 1, or None for its default",
    ),
    "gpipe microbatches=-2": (_parameters("gpipe", microbatches=-2), RecipeError, r"'microbatches' is -2; it must be int >= 1"),
    "zb1 stages=-1": (_parameters("zb1", stages=-1), RecipeError, r"recipe 'zb1': parameter 'stages' is -1; it must be int >= 1"),
    "interleaved virtual_stages=0": (_parameters("interleaved", virtual_stages=0), RecipeError, r"'virtual_stages' is 0; it must be int >= 1"),
    "hybrid3d pp=0": (_parameters("hybrid3d", dp=1, tp=1, pp=0), RecipeError, r"recipe 'hybrid3d': parameter 'pp' is 0; it must be int >= 1 \("),
    "tp degree=0": (_parameters("tp", degree=0), RecipeError, r"recipe 'tp': parameter 'degree' is 0; it must be int >= 1, or None"),
    "hydra recipe.params.microbatches=0": (
        _hydra("1f1b", microbatches=0), ValueError, r"recipe\.params\.microbatches=0: .*'microbatches' is 0; it must be int >= 1",
    ),
    "NnScalerStrategy(recipe='1f1b', microbatches=0)": (
        _strategy(recipe="1f1b", microbatches=0), RecipeError,
        r"NnScalerStrategy\(recipe='1f1b', \.\.\.\): recipe '1f1b': parameter 'microbatches' is 0; it must be int >= 1",
    ),
    "NnScalerStrategy(recipe='gpipe', stages=0)": (
        _strategy(recipe="gpipe", stages=0), RecipeError, r"recipe 'gpipe': parameter 'stages' is 0; it must be int >= 1",
    ),
    "NnScalerStrategy(timeout=0)": (_strategy(timeout=0), ValueError, r"NnScalerStrategy\(timeout=0\): .*a finite number > 0"),
    "NnScalerStrategy(timeout=-5.0)": (_strategy(timeout=-5.0), ValueError, r"NnScalerStrategy\(timeout=-5\.0\): .*> 0"),
    "NnScalerStrategy(timeout=nan)": (_strategy(timeout=float("nan")), ValueError, r"NnScalerStrategy\(timeout=nan\): .*> 0"),
    "NnScalerStrategy(timeout='60')": (_strategy(timeout="60"), ValueError, r"NnScalerStrategy\(timeout='60'\): .*number > 0"),
    "NnScalerStrategy(compile_options=...) without compile=True": (
        _strategy(compile_options={"backend": "aot_eager"}), ValueError,
        r"NnScalerStrategy\(compile_options=\{'backend': 'aot_eager'\}\) compiles nothing without compile=True",
    ),
    "NnScalerStrategy(compile=True, compile_options={'backnd': ...})": (
        _strategy(compile=True, compile_options={"backnd": "inductor"}), ValueError,
        r"compile_options \['backnd'\]: not options of torch.compile \(it takes backend, ",
    ),
    "dp over 4 replicas, a batch of 2 rows": (
        _plan(2, "dp", 4), ValueError,
        r"recipe 'dp' on 4 ranks splits the batch over 4 data-parallel replicas \(dp=4\), but batch input %\w+ has 2 rows, "
        r"fewer rows than its 4 replicas: some replica would get no rows\. Give a batch of a multiple of 4 rows",
    ),
    "zero3 over 4 replicas, a batch of 6 rows": (
        _plan(6, "zero3", 4), ValueError, r"has 6 rows, rows that its 4 replicas do not divide.*a multiple of 4 rows",
    ),
    "1f1b microbatches=4, a batch of 2 rows": (
        _plan(2, "1f1b", 2, microbatches=4), ValueError,
        r"1f1b: microbatches \(4\) must divide each replica's batch \(2 rows\): one of \[1, 2\]\. Use a larger batch_size \(a multiple of 4 rows per replica\), fewer microbatches \(or None.*"
        r"DataLoader\(drop_last=True\) if only the last batch is smaller",
    ),
    "gpipe 2 replicas x microbatches=2, a batch of 2 rows": (
        _plan(2, "gpipe", 4, stages=2, microbatches=2), ValueError, r"gpipe: microbatches \(2\) must divide each replica's batch \(1 row\): one of \[1\]",
    ),
    "interleaved, a ragged batch of 1 row": (
        _plan(1, "interleaved", 2), ValueError,
        r"interleaved: each replica's batch \(1 row\) cannot be cut into microbatches: they must divide it and be a multiple of the 2 "
        r"pipeline ranks .*, and no number does\. Use a larger batch_size \(a multiple of 2 rows per replica\), or DataLoader\(drop_last=True\)",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_bad_input_is_refused_naming_the_key_its_value_and_what_is_allowed(name: str) -> None:
    run, kind, pattern = CASES[name]
    with pytest.raises(kind, match=pattern):
        run()


def test_every_count_parameter_of_the_catalog_has_a_minimum() -> None:
    counts = {"stages", "microbatches", "virtual_stages", "dp", "tp", "pp", "degree", "max_pp"}  # a pipeline's shards: its own check
    for spec in list_recipes():
        if spec.origin == "register_recipe":
            continue
        for key, parameter in spec.parameters.items():
            if key in counts:
                assert parameter.minimum is not None and parameter.minimum >= 1, f"{spec.name}.{key}"
    assert load_recipe("coshard").parameters["shards"].minimum == 1


def test_a_ragged_batch_still_plans_with_the_default_microbatches() -> None:
    plan = _plan(1, "1f1b", 2)()  # a ragged last batch of 1 row: None picks 1 microbatch for it
    assert plan.pipeline.schedule.microbatches == 1
    plan.verify()


def test_a_registered_recipe_declares_minimums(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(catalog, "_REGISTRY", dict(catalog._REGISTRY))  # the catalog other tests list is left as it was
    def counted_dp(graph: lnn.Graph, ctx: Any, *, parts: int = 2) -> None:
        dp(graph, ctx)

    register_recipe(counted_dp, name="zz_counted_dp_refusals", parameter_docs={"parts": "Parts."}, parameter_minimums={"parts": 1}, replace=True)
    spec = load_recipe("zz_counted_dp_refusals")
    assert (spec.parameters["parts"].minimum, spec.parameters["parts"].doc) == (1, "Parts.")
    with pytest.raises(RecipeError, match=r"recipe 'zz_counted_dp_refusals': parameter 'parts' is 0; it must be int >= 1 \(parts: Parts\.\)"):
        spec.check_parameters({"parts": 0})
    def named(graph: lnn.Graph, ctx: Any, *, mode: str = "a") -> None:
        dp(graph, ctx)

    with pytest.raises(RecipeError, match=r"parameter 'mode' is str, so it cannot have a minimum"):
        register_recipe(named, name="zz_string_minimum_refusals", parameter_minimums={"mode": 1})
    bad = "name: bad\nfunction: lightning_nnscaler.plans.coshard:coshard\nsummary: s\nparameters:\n  shards:\n    doc: d\n    minimum: one\n  recompute: r\n"
    (tmp_path / "bad.yaml").write_text(bad)
    with pytest.raises(RecipeError, match=re.escape("or to a mapping of 'doc' (a string) and 'minimum' (a number), e.g. 'minimum: 1'; parameter 'shards'")):
        load_recipe("bad", tmp_path)
    (tmp_path / "bad.yaml").write_text(bad.replace("minimum: one", "minimum: 0").replace("  recompute: r\n", "  recompute:\n    doc: r\n"))
    assert load_recipe("bad", tmp_path).parameters["shards"].minimum == 0
    (tmp_path / "bad.yaml").write_text(bad.replace("minimum: one", "minimum: 5").replace("  recompute: r\n", "  recompute:\n    doc: r\n"))
    with pytest.raises(RecipeError, match=r"parameter 'shards' is 4; it must be int >= 5"):  # the default 4 is below it
        load_recipe("bad", tmp_path)
