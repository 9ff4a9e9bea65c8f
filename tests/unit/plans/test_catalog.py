"""The recipe catalog: every YAML maps to its function; parameters are checked before the graph is touched."""

from __future__ import annotations

import inspect

import pytest

from lightning_nnscaler.plans import RecipeError, apply_recipe, list_recipes, load_recipe
from lightning_nnscaler.plans.catalog import ParameterSpec, keyword_parameters

RECIPES = ["coshard", "dp", "hybrid", "sp", "tp", "zero1", "zero3"]


def test_catalog_lists_every_recipe() -> None:
    assert [spec.name for spec in list_recipes()] == RECIPES


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_file_matches_its_function(name) -> None:
    spec = load_recipe(name)
    assert spec.summary and spec.constraints and spec.function.startswith("lightning_nnscaler.plans.")
    function = spec.load_function()
    assert list(inspect.signature(function).parameters)[:2] == ["graph", "ctx"]
    keywords = keyword_parameters(function)
    assert list(keywords) == list(spec.parameters)
    for key, parameter in keywords.items():
        documented = spec.parameters[key]
        assert documented.doc
        if documented.required:
            assert parameter.default is inspect.Parameter.empty, key
        else:
            assert parameter.default == documented.default, key


def test_wrong_type_names_recipe_key_and_type(gpt) -> None:
    with pytest.raises(RecipeError, match=r"recipe 'coshard': parameter 'shards' expects int, got str '4'"):
        apply_recipe(gpt.graph.copy(), "coshard", 2, shards="4")
    with pytest.raises(RecipeError, match=r"parameter 'shards' expects int, got bool True"):
        apply_recipe(gpt.graph.copy(), "coshard", 2, shards=True)
    with pytest.raises(RecipeError, match=r"recipe 'coshard': parameter 'recompute' expects bool, got int 1"):
        apply_recipe(gpt.graph.copy(), "coshard", 2, recompute=1)
    apply_recipe(gpt.graph.copy(), "tp", 2, degree=None)  # None is allowed where it is the default


def test_unknown_and_missing_parameters_are_named(gpt) -> None:
    with pytest.raises(RecipeError, match=r"recipe 'coshard': unknown parameter 'shard'; its parameters are: shards \(int\), recompute \(bool\)"):
        apply_recipe(gpt.graph.copy(), "coshard", 2, shard=2)
    with pytest.raises(RecipeError, match=r"recipe 'dp': unknown parameter 'degree'; its parameters are: none"):
        apply_recipe(gpt.graph.copy(), "dp", 2, degree=2)
    with pytest.raises(RecipeError, match=r"recipe 'hybrid': parameter 'tp' \(int\) is required"):
        apply_recipe(gpt.graph.copy(), "hybrid", 2, dp=2)


def test_unknown_recipe_lists_the_catalog(gpt) -> None:
    with pytest.raises(RecipeError, match=r"unknown recipe 'megatron'; the catalog .* has: coshard, dp, hybrid, sp, tp, zero1, zero3"):
        apply_recipe(gpt.graph.copy(), "megatron", 2)


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


def test_parameter_types() -> None:
    number = ParameterSpec("rate", "float", "A rate.", default=0.5)
    number.check("r", 1)  # an int is a float
    with pytest.raises(RecipeError, match="expects float, got str"):
        number.check("r", "0.5")
    with pytest.raises(RecipeError, match="expects str, got int 3"):
        ParameterSpec("mode", "str", "A mode.", default="a").check("r", 3)


def test_malformed_recipe_files_are_named(tmp_path) -> None:
    (tmp_path / "broken.yaml").write_text("name: broken\nfunction: m:f\nsummary: s\nparameters:\n  x: {type: int, default: 1}\n")
    with pytest.raises(RecipeError, match=r"broken.yaml: parameter 'x' needs 'type' .* and 'doc'"):
        list_recipes(tmp_path)
    (tmp_path / "broken.yaml").write_text("name: other\nfunction: m:f\nsummary: s\n")
    with pytest.raises(RecipeError, match="name 'other' must be the file's stem 'broken'"):
        load_recipe("broken", tmp_path)
    (tmp_path / "broken.yaml").write_text("name: broken\nfunction: m:f\nsummary: s\nparameters:\n  x: {type: int, default: two, doc: d}\n")
    with pytest.raises(RecipeError, match="parameter 'x' expects int, got str 'two'"):
        load_recipe("broken", tmp_path)
    (tmp_path / "broken.yaml").write_text("name: broken\nfunction: no.such.module:f\nsummary: s\n")
    with pytest.raises(RecipeError, match="cannot import function 'no.such.module:f'"):
        load_recipe("broken", tmp_path).load_function()
