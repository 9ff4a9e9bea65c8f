"""The training app's configs: every model x recipe composes with Hydra's compose API and builds its
objects; every group option composes into a typed job config; bad overrides fail naming the key."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from hydra.utils import instantiate
from omegaconf.errors import OmegaConfBaseException

import lightning_nnscaler as lnn
from lightning_nnscaler.app.config import CONF_DIR, ConfigError, check_fit, job_config
from lightning_nnscaler.app.data import build_loaders
from lightning_nnscaler.app.recipes import recipe_entry, register_catalog_recipes

import lightning as L  # noqa: E402 - after lightning_nnscaler


def options(group: str) -> list[str]:
    return sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml"))


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose("train", overrides=list(overrides))


def data_for(model: str) -> str:
    """Byte text feeds the GPT (vocab 256); the other reference models take their own example batches."""
    return "stdlib_text" if model == "gpt" else "synthetic"


@pytest.mark.parametrize("recipe", options("recipe"))
@pytest.mark.parametrize("model", options("model"))
def test_every_model_and_recipe_composes_and_builds_its_objects(model: str, recipe: str) -> None:
    job = job_config(composed(f"model={model}", f"recipe={recipe}", f"data={data_for(model)}", "logger=none"))
    module = instantiate(job.model)
    assert isinstance(module, L.LightningModule)
    strategy = lnn.NnScalerStrategy(recipe=job.recipe.name, **job.recipe.params)
    assert (strategy.recipe, strategy.recipe_params) == (recipe, job.recipe.params)
    world_size = job.devices_world_size
    try:
        layout = check_fit(job, module, world_size)
    except ConfigError as error:  # the model's attention heads do not take this recipe's pieces on 2 ranks
        assert f"recipe={recipe}" in str(error) and "heads" in str(error)
        return
    if model != "gpt":  # the GPT's loaders read the standard library (tested below, once)
        loaders = build_loaders(job.data, module, job.batch_size, layout.data_parallel, job.seed)
        assert loaders.steps_per_epoch >= 1
    trainer = L.Trainer(strategy=strategy, logger=False, enable_checkpointing=False, enable_progress_bar=False, **job.trainer)
    assert trainer.max_steps == job.trainer["max_steps"]


@pytest.mark.parametrize("group", ["trainer", "logger", "data", "experiment"])
def test_every_group_option_composes_into_a_job_config(group: str) -> None:
    for option in options(group):
        overrides = [f"{group}={option}"] + (["model=swin"] if group == "data" and option == "synthetic" else [])
        job = job_config(composed(*overrides))
        assert job.recipe.name in {spec.name for spec in lnn.list_recipes()}


def test_the_default_job_is_gpt_on_stdlib_text_with_tp_on_two_cpu_ranks() -> None:
    job = job_config(composed())
    assert (job.recipe.name, job.data.kind, job.logger.kind, job.devices_world_size, job.trainer["accelerator"]) == ("tp", "stdlib_text", "wandb", 2, "cpu")
    module = instantiate(job.model)
    layout = check_fit(job, module, 2)
    loaders = build_loaders(job.data, module, job.batch_size, layout.data_parallel, job.seed)
    tokens, targets = next(iter(loaders.train))
    assert tokens.shape == (job.batch_size, module.config.seq_len) and int(tokens.max()) < 256
    assert (tokens[:, 1:] == targets[:, :-1]).all()


def test_every_catalog_recipe_is_a_recipe_option() -> None:
    """The catalog is the one source of truth: every conf/recipe file names a catalog recipe (its params
    are checked by the model x recipe test), and a catalog recipe without a file gets a generated entry."""
    catalog = {spec.name for spec in lnn.list_recipes() if spec.origin != "register_recipe"}
    assert set(options("recipe")) <= catalog
    generated = register_catalog_recipes(CONF_DIR)
    assert set(generated) == catalog - set(options("recipe"))
    for name in generated:
        job = job_config(composed(f"recipe={name}", "logger=none"))
        assert (job.recipe.name, set(job.recipe.params)) == (name, set(lnn.load_recipe(name).parameters))


def test_a_catalog_recipe_without_a_conf_file_gets_a_generated_entry(tmp_path: Path) -> None:
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    (conf / "recipe" / "coshard.yaml").unlink()
    store = ConfigStore.instance()
    try:
        assert "coshard" in register_catalog_recipes(conf)
        assert store.load("recipe/coshard.yaml").node["params"] == recipe_entry(lnn.load_recipe("coshard"))["params"]
        with initialize_config_dir(config_dir=str(conf), version_base=None):
            job = job_config(compose("train", overrides=["recipe=coshard", "recipe.params.shards=1"]))
    finally:  # the real conf/recipe/coshard.yaml must not be matched against a stored schema in later tests
        store.repo["recipe"].pop("coshard.yaml", None)
    assert (job.recipe.name, job.recipe.params["shards"]) == ("coshard", 1)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["recipe.params.shards=abc", "recipe=coshard"], "recipe.params.shards"),
        (["recipe=dp", "+recipe.params.degree=2"], "recipe.params.degree"),
        (["recipe.name=no_such_recipe"], "recipe.name"),
        (["+trainer.no_such_argument=1"], "trainer.no_such_argument"),
        (["batch_size=abc"], "batch_size"),
        (["data.validation_batches=0"], "data.validation_batches"),
        (["logger.kind=mlflow"], "logger.kind"),
        (["spec=tpu9"], "spec"),
        (["compile=maybe"], "compile"),
        (["compile=true", "+compile_options.no_such_option=1"], "no_such_option"),
        (["+compile_options.backend=aot_eager"], "compile_options"),
    ],
)
def test_a_bad_override_fails_naming_the_key(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        job_config(composed(*overrides))


def test_an_unknown_recipe_option_or_key_fails_in_composition_naming_it() -> None:
    with pytest.raises(HydraException, match="recipe/no_such_recipe"):
        composed("recipe=no_such_recipe")
    with pytest.raises((HydraException, OmegaConfBaseException), match="no_such_key"):
        composed("trainer.no_such_key=1")


def test_indivisible_shards_fail_naming_the_parameter_and_the_heads() -> None:
    job = job_config(composed("recipe=coshard", "recipe.params.shards=3"))
    with pytest.raises(ConfigError, match=r"recipe\.params\.shards=3.*heads"):
        check_fit(job, instantiate(job.model), job.devices_world_size)


def test_data_the_model_cannot_take_fails_naming_data() -> None:
    job = job_config(composed("model=swin", "data=stdlib_text"))
    with pytest.raises(ConfigError, match="data=stdlib_text"):
        build_loaders(job.data, instantiate(job.model), job.batch_size, 2, job.seed)


def test_the_plan_command_predicts_on_the_spec_asked_for_else_on_the_trainers_devices() -> None:
    import torch

    from lightning_nnscaler.app.plan_command import prediction_spec

    assert prediction_spec(job_config(composed("spec=h200"))) == ("h200", "spec=h200")
    assert prediction_spec(job_config(composed())) == ("cpu", "trainer.accelerator=cpu")
    if not torch.cuda.is_available():
        spec, reason = prediction_spec(job_config(composed("trainer=gpu")))
        assert spec == "a100" and "no GPU here" in reason


def test_cli_hands_hydra_flags_of_train_and_plan_through_untouched() -> None:
    from lightning_nnscaler.cli import split_hydra_command

    assert split_hydra_command(["train", "-m", "recipe=dp,tp"]) == ([], ["train", "-m", "recipe=dp,tp"])
    assert split_hydra_command(["--import", "my.recipes", "plan", "world_size=8"]) == (["--import", "my.recipes"], ["plan", "world_size=8"])
    assert split_hydra_command(["recipes"]) is None


def composed_with_hydra(*overrides: str):
    """``compose`` with the ``hydra`` node split off, as the app sees the config and its ``HydraConfig``."""
    from omegaconf import open_dict

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        config = compose("train", overrides=list(overrides), return_hydra_config=True)
    hydra = config.hydra
    with open_dict(config):
        del config["hydra"]
    return config, hydra


def test_an_own_module_target_gets_only_the_arguments_the_command_line_sets() -> None:
    """``model._target_=my_package.MyModule``: the gpt file's ``config`` belongs to GPT and is left out;
    an argument the user adds goes through (a misspelt one then fails in the constructor, naming it)."""
    own = job_config(*composed_with_hydra("model._target_=my_package.MyModule", "data=synthetic"))
    assert own.model == {"_target_": "my_package.MyModule"}
    own = job_config(*composed_with_hydra("model._target_=my_package.MyModule", "+model.hidden=32", "model.config.layers=1"))
    assert set(own.model) == {"_target_", "hidden", "config"} and own.model["config"]["layers"] == 1
    shipped = job_config(*composed_with_hydra("model=swin", "model._target_=lightning_nnscaler.models.swin.Swin"))
    assert set(shipped.model) == {"_target_", "config"}
    assert job_config(composed("model._target_=my_package.MyModule")).model["config"]["hidden"] == 64  # no hydra node: as composed


def test_a_registered_recipe_is_a_recipe_option_with_its_defaults() -> None:
    from lightning_nnscaler.app.recipes import register_user_recipes

    @lnn.register_recipe(name="app_user_recipe", parameter_docs={"pieces": "Pieces."}, replace=True)
    def app_user_recipe(graph: lnn.Graph, ctx: lnn.PlanContext, *, pieces: int = 2) -> None:
        """Replicate everything (a placeholder plan)."""

    store = ConfigStore.instance()
    try:
        assert "app_user_recipe" in register_user_recipes()
        job = job_config(composed("recipe=app_user_recipe", "recipe.params.pieces=3"))
    finally:
        store.repo["recipe"].pop("app_user_recipe.yaml", None)
    assert (job.recipe.name, job.recipe.params) == ("app_user_recipe", {"pieces": 3})


def test_the_sweep_table_names_each_jobs_global_batch(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """dp on 2 ranks steps on twice tp's samples at one batch_size: the table says so beside the losses."""
    import csv
    import json

    from lightning_nnscaler.app.summary import write_comparison

    for job, (recipe, global_batch, loss) in enumerate([("dp", 32, 2.1), ("tp", 16, 2.4)]):
        (tmp_path / str(job)).mkdir()
        result = {"recipe": recipe, "params": {}, "world_size": 2, "global_batch": global_batch, "final_train_loss": loss, "step_time_s": 0.01}
        (tmp_path / str(job) / "result.json").write_text(json.dumps(result))
    (tmp_path / "2").mkdir()  # a failed job: no global batch to report
    (tmp_path / "2" / "result.json").write_text(json.dumps({"recipe": "coshard", "params": {}, "error": "boom"}))
    with write_comparison(tmp_path).open() as handle:
        rows = list(csv.DictReader(handle))
    assert [(row["recipe"], row["global_batch"], row["final_train_loss"]) for row in rows] == [("dp", "32", "2.1"), ("tp", "16", "2.4"), ("coshard", "", "")]
    header, dp_row = capsys.readouterr().out.splitlines()[:2]
    assert header.split()[:5] == ["job", "recipe", "params", "world_size", "global_batch"] and dp_row.split()[:5] == ["0", "dp", "{}", "2", "32"]


def test_compile_reaches_the_strategy_with_its_options() -> None:
    """``compile=true compile_options.backend=...`` on the command line becomes ``NnScalerStrategy(compile=True, ...)``."""
    job = job_config(composed("compile=true", "+compile_options.backend=aot_eager"))
    assert job.compile is True and job.compile_options == {"backend": "aot_eager"}
    strategy = lnn.NnScalerStrategy(recipe=job.recipe.name, compile=job.compile, compile_options=job.compile_options or None)
    assert strategy.compile is not None and strategy.compile.options == {"backend": "aot_eager"}
    assert job_config(composed()).compile is False
