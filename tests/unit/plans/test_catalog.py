"""The recipe catalog: parameters come from the recipes' config dataclasses (documented by their fields),
names are names, a user's own recipe is registered from Python and then works everywhere."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import pytest

import lightning_nnscaler as lnn
from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir.validate import PlanError
from lightning_nnscaler.plans import RecipeError, apply_recipe, list_recipes, load_recipe
import dataclasses

from lightning_nnscaler.plans.catalog import ParameterSpec, register_recipe
from lightning_nnscaler.plans.context import PlanContext
from lightning_nnscaler.plans.dp import dp
from lightning_nnscaler.plans.layout import DeviceGrid, RecipeLayout, data_parallel_layout

RECIPES = ["1f1b", "3f1b", "auto", "coshard", "dp", "dualpipev", "gpipe", "hybrid", "hybrid3d", "interlaced", "interleaved", "sp", "tp", "vhalf", "zb1", "zbv", "zero1", "zero3"]


def test_catalog_lists_every_built_in_recipe() -> None:
    assert [spec.name for spec in list_recipes() if spec.origin != "register_recipe"] == RECIPES


@pytest.mark.parametrize("name", RECIPES)
def test_parameters_are_the_config_fields(name) -> None:
    spec = load_recipe(name)
    # auto drives the simulator, which reads plans: it lives above them, in sim (tests/unit/test_layering.py)
    home = "lightning_nnscaler.sim." if name == "auto" else "lightning_nnscaler.plans."
    assert spec.summary and spec.constraints and spec.function.__module__.startswith(home)
    assert list(inspect.signature(spec.function).parameters)[:2] == ["graph", "ctx"]
    assert dataclasses.is_dataclass(spec.config) and spec.config.__dataclass_params__.frozen
    fields = {field.name: field for field in dataclasses.fields(spec.config)}
    assert list(fields) == list(spec.parameters) and all(field.kw_only for field in fields.values())
    for key, field in fields.items():
        documented = spec.parameters[key]
        assert documented.doc, key
        assert documented.required == (field.default is dataclasses.MISSING), key
        if not documented.required:
            assert field.default == documented.default, key
    # a built-in takes its config (auto, above plans in sim, keeps keyword-only parameters: the catalog makes its config)
    assert spec.takes_config == (name != "auto" and bool(fields))


def test_parameter_types_come_from_annotations() -> None:
    tp, coshard = load_recipe("tp").parameters, load_recipe("coshard").parameters
    assert (tp["degree"].type, tp["degree"].nullable, tp["degree"].default) == ("int", True, None)
    assert (coshard["shards"].type, coshard["recompute"].type) == ("int", "bool")


def test_wrong_type_names_recipe_key_and_type(gpt) -> None:
    with pytest.raises(RecipeError, match=r"recipe 'coshard': parameter 'shards' expects int, got str '4'"):
        apply_recipe(gpt.graph.copy(), "coshard", 2, shards="4")
    with pytest.raises(RecipeError, match=r"parameter 'shards' expects int, got bool True"):
        apply_recipe(gpt.graph.copy(), "coshard", 2, shards=True)
    with pytest.raises(RecipeError, match=r"recipe 'coshard': parameter 'recompute' expects bool, got int 1"):
        apply_recipe(gpt.graph.copy(), "coshard", 2, recompute=1)
    apply_recipe(gpt.graph.copy(), "tp", 2, degree=None)  # None is allowed: the annotation is int | None


def test_unknown_and_missing_parameters_are_named(gpt) -> None:
    with pytest.raises(RecipeError, match=r"recipe 'coshard': unknown parameter 'shard'; its parameters are: shards \(int\), recompute \(bool\)"):
        apply_recipe(gpt.graph.copy(), "coshard", 2, shard=2)
    with pytest.raises(RecipeError, match=r"recipe 'dp': unknown parameter 'degree'; its parameters are: none"):
        apply_recipe(gpt.graph.copy(), "dp", 2, degree=2)
    with pytest.raises(RecipeError, match=r"recipe 'hybrid': parameter 'tp' \(int\) is required"):
        apply_recipe(gpt.graph.copy(), "hybrid", 2, dp=2)


def test_unknown_recipe_lists_the_catalog(gpt) -> None:
    with pytest.raises(RecipeError, match=r"unknown recipe 'megatron'; the catalog has: 1f1b, 3f1b, (\w+, )*auto, coshard, dp, dualpipev, gpipe, hybrid, (\w+, )*zero1, zero3.*register_recipe"):
        apply_recipe(gpt.graph.copy(), "megatron", 2)


@pytest.mark.parametrize("name", ["../recipes/tp", "recipes/tp.yaml", "/etc/passwd", "tp.yaml", "TP", "", "lightning_nnscaler.plans.dp:dp", 3])
def test_a_recipe_name_that_is_not_a_name_is_refused(name, gpt) -> None:
    with pytest.raises(RecipeError, match=r"is not a recipe name: a name is lower-case letters, digits and '_'.*never a path"):
        load_recipe(name)
    with pytest.raises(RecipeError, match="is not a recipe name"):
        apply_recipe(gpt.graph.copy(), name, 2)


def test_a_recipe_name_is_refused_by_the_strategy_before_any_process_starts() -> None:
    with pytest.raises(RecipeError, match="is not a recipe name"):
        lnn.NnScalerStrategy(recipe="../lightning_nnscaler/recipes/tp")


def test_a_failed_recipe_leaves_the_graph_unchanged(gpt) -> None:
    graph = gpt.graph.copy()
    before = str(graph)
    with pytest.raises(RecipeError):
        apply_recipe(graph, "coshard", 2, shards="many")
    with pytest.raises(ValueError, match=r"dp \(2\) × tp \(2\) = 4 must equal world_size \(2\)"):
        apply_recipe(graph, "hybrid", 2, dp=2, tp=2)
    assert str(graph) == before
    apply_recipe(graph, "tp", 2)
    assert graph.devices == [0, 1]


def test_parameter_spec_checks_values() -> None:
    number = ParameterSpec("rate", "float", "A rate.", default=0.5)
    number.check("r", 1)  # an int is a float
    with pytest.raises(RecipeError, match="expects float, got str"):
        number.check("r", "0.5")
    with pytest.raises(RecipeError, match="expects str, got int 3"):
        ParameterSpec("mode", "str", "A mode.", default="a").check("r", 3)


def test_malformed_recipe_files_are_named(tmp_path) -> None:
    (tmp_path / "broken.yaml").write_text("name: broken\nfunction: lightning_nnscaler.sim.auto:auto\nsummary: s\nparameters:\n  spec: doc\n")
    with pytest.raises(RecipeError, match=r"parameter\(s\) memory_limit_gb, recipes, max_pp of auto_config have no doc: give each field a docstring"):
        list_recipes(tmp_path)
    (tmp_path / "broken.yaml").write_text("name: broken\nfunction: lightning_nnscaler.plans.coshard:coshard\nsummary: s\nparameters:\n  shards: doc\n")
    assert list_recipes(tmp_path)[0].parameters["shards"].doc == "doc"  # the file's doc, over the field's docstring
    (tmp_path / "broken.yaml").write_text("name: other\nfunction: m:f\nsummary: s\n")
    with pytest.raises(RecipeError, match="name 'other' must be the file's stem 'broken'"):
        load_recipe("broken", tmp_path)
    (tmp_path / "broken.yaml").write_text("name: broken\nfunction: lightning_nnscaler.plans.dp:dp\nsummary: s\nparameters:\n  x: d\n")
    with pytest.raises(RecipeError, match=r"documents parameter\(s\) x that dp_config does not have"):
        load_recipe("broken", tmp_path)
    (tmp_path / "broken.yaml").write_text("name: broken\nfunction: no.such.module:f\nsummary: s\n")
    with pytest.raises(RecipeError, match="cannot import function 'no.such.module:f'"):
        load_recipe("broken", tmp_path)


def every_other_block_on_device_zero(graph: Graph, ctx: PlanContext, *, replicas: int = 2) -> None:
    """A user's recipe: data parallelism over ``replicas`` ranks (the built-in dp function)."""
    dp(graph, ctx)


def test_a_registered_recipe_plans_verifies_and_is_listed(gpt_model) -> None:
    model, batch = gpt_model
    register_recipe(
        every_other_block_on_device_zero, name="my_data_parallel", parameter_docs={"replicas": "Ranks."},
        layout=data_parallel_layout, replace=True,
    )
    spec = load_recipe("my_data_parallel")
    assert spec.parameters["replicas"] == ParameterSpec("replicas", "int", "Ranks.", False, 2, False)
    assert "my_data_parallel" in [recipe.name for recipe in list_recipes()]
    plan = lnn.parallelize(model, batch, "my_data_parallel", 2, step="training_step", replicas=2)
    assert plan.data_layout.data_parallel == 2
    plan.verify()
    with pytest.raises(RecipeError, match="expects int, got str"):
        lnn.parallelize(model, batch, "my_data_parallel", 2, step="training_step", replicas="2")


def test_registering_a_taken_or_bad_name_is_refused() -> None:
    with pytest.raises(RecipeError, match=r"the name 'tp' is taken by .*tp.yaml; pick another name"):
        register_recipe(every_other_block_on_device_zero, name="tp")
    with pytest.raises(RecipeError, match="is not a recipe name"):
        register_recipe(every_other_block_on_device_zero, name="my/recipe")

    def untyped(graph, ctx, *, parts=2):  # noqa: ANN001 - the point of the test
        pass

    with pytest.raises(RecipeError, match=r"parameter 'parts' must be annotated int, bool, float or str"):
        register_recipe(untyped, name="untyped_recipe")


def test_a_layout_that_does_not_match_the_plan_is_refused(gpt_model) -> None:
    """A recipe that declares one data-parallel replica per rank but needs the whole batch on every rank (tp)."""
    model, batch = gpt_model
    from lightning_nnscaler.plans.megatron_tp import tp

    register_recipe(tp, name="tp_with_a_wrong_layout", parameter_docs={"degree": "d"}, layout=data_parallel_layout, replace=True)
    with pytest.raises(PlanError, match=r"rank 0 reads rows \[0, 2\) of batch input .* replica 0 of 2 .* loads rows \[0, 1\)"):
        lnn.parallelize(model, batch, "tp_with_a_wrong_layout", 2, step="training_step")


def test_a_layout_for_another_world_size_is_refused() -> None:
    register_recipe(
        every_other_block_on_device_zero, name="fixed_grid", layout=lambda world_size, params: RecipeLayout(DeviceGrid.of(dp=2)), replace=True
    )
    with pytest.raises(RecipeError, match=r"recipe 'fixed_grid': its layout dp=2 has 2 ranks, not world_size=4"):
        load_recipe("fixed_grid").layout(4, {})


def test_the_cli_lists_a_recipe_registered_by_an_imported_module(tmp_path) -> None:
    (tmp_path / "my_recipes.py").write_text(textwrap.dedent('''
        import lightning_nnscaler as lnn
        from lightning_nnscaler.plans.dp import dp

        @lnn.register_recipe(name="cli_recipe", summary="My data parallelism.", parameter_docs={"scale": "A factor."})
        def cli_recipe(graph, ctx, *, scale: float = 1.0) -> None:
            dp(graph, ctx)
    '''))
    completed = subprocess.run(
        [sys.executable, "-m", "lightning_nnscaler.cli", "--import", "my_recipes", "recipes"], capture_output=True, text=True,
        cwd=tmp_path, env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)}, timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    assert "cli_recipe" in completed.stdout and "My data parallelism. [scale: float = 1.0]" in completed.stdout
    assert "tp " in completed.stdout
