"""Hydra configs: every group option composes, builds its object and names a valid recipe setting."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

import lightning_nnscaler as lnn

CONF = Path(__file__).resolve().parents[2] / "conf"


def options(group: str) -> list[str]:
    return sorted(path.stem for path in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("model", options("model"))
def test_every_model_config_builds_a_model_that_steps(model: str) -> None:
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        config = compose("train", overrides=[f"model={model}"])
    module = instantiate(config.model)
    batch = module.example_batch(config.batch_size, torch.Generator().manual_seed(config.seed))
    graph = lnn.trace(module, batch, step="training_step")
    assert graph.outputs and graph.parameters


@pytest.mark.parametrize("recipe", options("recipe"))
def test_every_recipe_config_names_a_catalog_recipe_with_valid_parameters(recipe: str) -> None:
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        config = compose("train", overrides=[f"recipe={recipe}"])
    spec = lnn.load_recipe(config.recipe.name)
    params = OmegaConf.to_container(config.recipe.params)
    spec.check_parameters(params)
    # The catalog (the plan function's signature) declares the parameters; the Hydra option lists
    # every one of them, with the signature's default wherever there is one.
    assert list(params) == list(spec.parameters)
    assert {key: value for key, value in params.items() if not spec.parameters[key].required} == {
        key: parameter.default for key, parameter in spec.parameters.items() if not parameter.required
    }
    built_ins = {spec.name for spec in lnn.list_recipes() if spec.origin != "register_recipe"}
    assert set(options("recipe")) == built_ins


def test_a_registered_recipe_is_a_hydra_recipe_name() -> None:
    """A user's recipe, registered from Python, is selected by ``recipe.name`` and builds the strategy."""

    @lnn.register_recipe(name="hydra_user_recipe", parameter_docs={"degree": "Pieces."}, replace=True)
    def hydra_user_recipe(graph: lnn.Graph, ctx: lnn.PlanContext, *, degree: int = 2) -> None:
        """Replicate everything (a placeholder plan)."""

    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        config = compose("train", overrides=["recipe.name=hydra_user_recipe", "+recipe.params.degree=3"])
    strategy = lnn.NnScalerStrategy(recipe=config.recipe.name, **OmegaConf.to_container(config.recipe.params))
    assert (strategy.recipe, strategy.recipe_params) == ("hydra_user_recipe", {"degree": 3})
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        config = compose("train", overrides=["recipe.name=../../etc/passwd"])
    with pytest.raises(lnn.RecipeError, match="is not a recipe name"):
        lnn.NnScalerStrategy(recipe=config.recipe.name)


def test_trainer_config_holds_trainer_arguments() -> None:
    import lightning as L

    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        config = compose("train", overrides=["trainer.devices=1", "trainer.max_steps=1"])
    trainer = L.Trainer(**OmegaConf.to_container(config.trainer), logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert trainer.max_steps == 1
