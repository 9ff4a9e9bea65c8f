"""One declaration of a recipe's parameters: its config dataclass. The catalog files, the Hydra options
(``conf/recipe/*.yaml``) and the CLI listing are checked against it; user input of every form (Python
values, Hydra lists, comma-separated strings) becomes the dataclass at the edge, or an error naming the
recipe, the key, the value, the type and the keys allowed."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import OmegaConf

from lightning_nnscaler.cli import recipe_line
from lightning_nnscaler.plans.catalog import RECIPES_DIR, RecipeError, RecipeSpec, apply_recipe, list_recipes, load_recipe
from lightning_nnscaler.plans.pipeline_recipes import PipelineConfig
from lightning_nnscaler.recipes.summaries import built_in_summaries

CONF_RECIPES = Path(__file__).resolve().parents[3] / "conf" / "recipe"
BUILT_INS = [path.stem for path in sorted(RECIPES_DIR.glob("*.yaml"))]


def conf_problems(path: Path, spec: RecipeSpec) -> list[str]:
    """What a ``conf/recipe`` file says that its recipe's config does not: names, their order, types and defaults."""
    data = yaml.safe_load(path.read_text())
    params: dict[str, Any] = data.get("params") or {}
    problems = [f"name {data.get('name')!r} is not {spec.name!r}"] if data.get("name") != spec.name else []
    problems += [f"{key}: {spec.config.__qualname__} has no such field" for key in params if key not in spec.parameters]
    problems += [f"{key}: missing (a field of {spec.config.__qualname__})" for key in spec.parameters if key not in params]
    if not problems and list(params) != list(spec.parameters):
        problems.append(f"order {list(params)} is not the fields' {list(spec.parameters)}")
    for key, value in params.items():
        parameter = spec.parameters.get(key)
        if parameter is None or value == "???" and parameter.required:
            continue
        try:
            converted = parameter.convert(spec.name, value)
        except RecipeError as error:
            problems.append(str(error))
            continue
        if not parameter.required and converted != parameter.default:  # a required one's value is the option's choice
            problems.append(f"{key}: default {value!r}, the config's is {parameter.default!r}")
    return problems


@pytest.mark.parametrize("name", BUILT_INS)
def test_every_hydra_option_matches_its_recipes_config(name: str) -> None:
    assert conf_problems(CONF_RECIPES / f"{name}.yaml", load_recipe(name)) == []


def test_a_hydra_option_that_differs_from_the_config_is_caught(tmp_path: Path) -> None:
    spec = load_recipe("1f1b")
    path = tmp_path / "1f1b.yaml"
    wrong = yaml.safe_load((CONF_RECIPES / "1f1b.yaml").read_text())
    wrong["params"] |= {"shards": 3, "stage": 2, "microbatches": "many"}
    path.write_text(yaml.safe_dump(wrong, sort_keys=False))
    problems = conf_problems(path, spec)
    assert "shards: default 3, the config's is 2" in problems
    assert "stage: PipelineConfig has no such field" in problems
    assert any("parameter 'microbatches' expects int, got str 'many'" in problem for problem in problems)


def test_a_catalog_file_naming_a_parameter_the_config_lacks_is_refused(tmp_path: Path) -> None:
    text = (RECIPES_DIR / "1f1b.yaml").read_text() + "parameters:\n  stage: One stage too few letters.\n"
    (tmp_path / "1f1b.yaml").write_text(text)
    with pytest.raises(RecipeError, match=r"documents parameter\(s\) stage that PipelineConfig does not have"):
        load_recipe("1f1b", tmp_path)


@pytest.mark.parametrize("name", BUILT_INS)
def test_a_built_in_config_is_frozen_keyword_only_and_documented(name: str) -> None:
    spec = load_recipe(name)
    assert spec.config.__dataclass_params__.frozen
    for field in dataclasses.fields(spec.config):
        assert field.kw_only and spec.parameters[field.name].doc, f"{name}.{field.name}"


def test_the_cli_listing_reads_the_config_fields() -> None:
    catalog = {spec.name: recipe_line(spec) for spec in list_recipes() if spec.origin != "register_recipe"}
    assert {summary.name: recipe_line(summary) for summary in built_in_summaries()} == catalog
    assert (
        "[stages: int | None = None, microbatches: int | None = None, balance: str = 'estimate', "
        "layers_per_stage: tuple[int, ...] | None = None," in catalog["1f1b"]
    )
    assert "hybrid     " in catalog["hybrid"] and "[dp: int (required), tp: int (required)]" in catalog["hybrid"]


@pytest.mark.parametrize("given", ["3,3,2", " 3, 3 ,2 ", [3, 3, 2], (3, 3, 2), OmegaConf.create([3, 3, 2])])
def test_a_list_parameter_takes_a_list_or_a_comma_separated_string(given: Any) -> None:
    config = load_recipe("1f1b").build_config({"layers_per_stage": given, "recompute_stages": 0})
    assert config == PipelineConfig(layers_per_stage=(3, 3, 2), recompute_stages=(0,))
    assert load_recipe("interlaced").build_config({"shared_layers": "embed, lm_head"}).shared_layers == ("embed", "lm_head")


def test_a_plan_from_a_list_is_the_plan_from_its_comma_string(gpt) -> None:
    from_text, _ = gpt.plan("1f1b", 2, layers_per_stage="1,1", recompute_stages="0")
    from_lists, _ = gpt.plan("1f1b", 2, layers_per_stage=[1, 1], recompute_stages=[0])
    assert str(from_lists) == str(from_text)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"stage": 2}, r"recipe '1f1b': unknown parameter 'stage'; its parameters are: stages \(int\), microbatches \(int\), "
                       r"balance \(str\), layers_per_stage \(tuple\[int, \.\.\.\]\), recompute_stages"),
        ({"stages": "2"}, r"recipe '1f1b': parameter 'stages' expects int, got str '2'"),
        ({"layers_per_stage": "3;3"}, r"recipe '1f1b': parameter 'layers_per_stage' expects tuple\[int, \.\.\.\]: a list such as "
                                      r"\[3, 3, 2\] or a comma-separated string such as '3,3,2', got str '3;3'"),
        ({"layers_per_stage": [3, "3"]}, r"parameter 'layers_per_stage' expects tuple\[int, \.\.\.\].*got list \[3, '3'\]"),
        ({"layers_per_stage": "3,-1"}, r"parameter 'layers_per_stage' has entry -1 in '3,-1'; each entry must be int >= 0"),
        ({"schedule_csv": 3}, r"recipe '1f1b': parameter 'schedule_csv' expects str, got int 3"),
    ],
)
def test_bad_input_is_refused_naming_recipe_key_value_and_type(params: dict[str, Any], message: str) -> None:
    with pytest.raises(RecipeError, match=message):
        load_recipe("1f1b").build_config(params)


def test_a_bad_list_leaves_the_graph_untouched(gpt) -> None:
    graph = gpt.graph.copy()
    with pytest.raises(RecipeError, match="'recompute_stages' expects tuple"):
        apply_recipe(graph, "gpipe", 2, recompute_stages="first")
    assert str(graph) == str(gpt.graph)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HalvesConfig:
    """A user's recipe config."""

    replicas: int = dataclasses.field(default=2, metadata={"minimum": 1})
    """Data-parallel replicas."""
    names: tuple[str, ...] | None = None
    """Op names (unused)."""


def halves(graph, ctx, config: HalvesConfig) -> None:  # noqa: ANN001 - a user's recipe as the README writes one
    """Data parallelism (the built-in dp), with a config."""
    from lightning_nnscaler.plans.dp import dp

    dp(graph, ctx)


def test_a_user_recipe_may_take_a_config_too(gpt) -> None:
    from lightning_nnscaler.plans.catalog import register_recipe

    register_recipe(halves, name="config_halves", replace=True)
    spec = load_recipe("config_halves")
    assert (spec.takes_config, list(spec.parameters), spec.parameters["replicas"].doc) == (True, ["replicas", "names"], "Data-parallel replicas.")
    assert spec.build_config({"names": "a,b"}) == HalvesConfig(names=("a", "b"))
    with pytest.raises(RecipeError, match=r"recipe 'config_halves': parameter 'replicas' is 0; it must be int >= 1 \(replicas: Data-parallel"):
        apply_recipe(gpt.graph.copy(), "config_halves", 2, replicas=0)
    graph = gpt.graph.copy()
    apply_recipe(graph, "config_halves", 2, names=["a"])
    assert graph.devices == [0, 1]
