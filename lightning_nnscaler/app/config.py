"""Typed configs of the training app, built from Hydra's composed ``DictConfig`` at the edge.

``job_config(cfg)`` checks what can be checked before anything is built (recipe name and parameter
types, Trainer arguments, sizes) and raises ``ConfigError`` naming the config key; ``check_fit``
checks, once the model exists, that the recipe's pieces fit the devices and the attention heads.
No ``DictConfig`` travels deeper than this module.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_nnscaler.ir.errors import NnScalerError
from lightning_nnscaler.plans.catalog import RecipeError, RecipeSpec, load_recipe

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
"""The Hydra config folder of a source checkout (``conf/`` beside the package)."""
DATA_KINDS = ("stdlib_text", "synthetic")
LOGGER_KINDS = ("wandb", "csv", "tensorboard", "none")


class ConfigError(NnScalerError, ValueError):
    """A config value that cannot work; the message names the key (e.g. ``recipe.params.shards``)."""


@dataclass(frozen=True, kw_only=True)
class RecipeConfig:
    """A catalog recipe and its parameters."""

    name: str
    """Catalog name (``lightning-nnscaler recipes`` lists them)."""
    params: dict[str, Any] = field(default_factory=dict)
    """The recipe function's keyword parameters."""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where batches come from."""

    kind: str
    """``stdlib_text`` (byte tokens of the standard library's source) or ``synthetic`` (the model's ``example_batch``)."""
    seq_len: int | None = None
    """Tokens per sample; None: the model's ``config.seq_len``."""
    validation_every: int = 10
    """stdlib_text: one file in about this many is held out for validation."""
    max_files: int | None = None
    """stdlib_text: read only the first files (by name); None reads all."""
    validation_batches: int = 8
    """Batches per validation run."""
    train_samples: int = 512
    """synthetic: training samples."""
    validation_samples: int = 64
    """synthetic: validation samples."""


@dataclass(frozen=True, kw_only=True)
class LoggerConfig:
    """The experiment logger (one of ``LOGGER_KINDS``); files go to the run folder."""

    kind: str
    project: str = "lightning-nnscaler"
    offline: bool = True
    """wandb: write the run locally (``wandb sync`` uploads it later)."""


@dataclass(frozen=True, kw_only=True)
class SampleConfig:
    """The text generated from the trained model at the end (data=stdlib_text)."""

    prompt: str = "def "
    tokens: int = 160
    """Bytes to generate; 0 skips the sample."""
    temperature: float = 0.8
    """Softmax temperature; 0 is greedy."""


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """One training job, typed."""

    model: dict[str, Any]
    """Hydra ``instantiate`` spec of the LightningModule (``_target_`` and its arguments)."""
    data: DataConfig
    recipe: RecipeConfig
    trainer: dict[str, Any]
    """``lightning.Trainer`` keyword arguments (checked against its signature)."""
    logger: LoggerConfig
    sample: SampleConfig
    seed: int = 0
    batch_size: int = 16
    """Per data-parallel replica (a DataLoader's batch_size)."""
    world_size: int | None = None
    """Ranks to plan for (the ``plan`` command); None: ``trainer.devices × trainer.num_nodes``."""
    spec: str | None = None
    """Hardware spec the ``plan`` command predicts on (a shipped spec's name or a YAML path); None: that of ``trainer``'s devices."""
    evaluations: int = 5
    threads_per_rank: int = 1
    compile: bool = False
    """Run the generated code under ``torch.compile`` (``NnScalerStrategy(compile=True)``)."""
    compile_options: dict[str, Any] = field(default_factory=dict)
    """``torch.compile``'s keyword arguments for it (checked when the strategy is made)."""

    @property
    def devices_world_size(self) -> int | None:
        """``trainer.devices × trainer.num_nodes`` when both are plain counts (None for "auto", -1 or a list)."""
        devices, nodes = self.trainer.get("devices", 1), self.trainer.get("num_nodes", 1)
        if isinstance(devices, int) and not isinstance(devices, bool) and devices > 0 and isinstance(nodes, int):
            return devices * nodes
        return None


def job_config(cfg: DictConfig, hydra: DictConfig | None = None) -> JobConfig:
    """The typed job config of a composed ``DictConfig`` (interpolations resolved).

    Args:
        cfg: The composed config, without its ``hydra`` node.
        hydra: The ``hydra`` node (``HydraConfig.get()``, or ``compose(..., return_hydra_config=True)``'s):
            its model choice and command-line overrides tell the model file's arguments from the user's
            (``model_arguments``). None keeps the model node as composed.

    Raises:
        ConfigError: naming the key whose value cannot work.
    """
    container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    assert isinstance(container, dict)
    recipe = _recipe(container.get("recipe"))
    data = _section(DataConfig, container, "data")
    logger = _section(LoggerConfig, container, "logger")
    sample = _section(SampleConfig, container, "sample")
    _choice("data.kind", data.kind, DATA_KINDS)
    _choice("logger.kind", logger.kind, LOGGER_KINDS)
    trainer = _trainer(container.get("trainer"))
    model = container.get("model")
    if not isinstance(model, dict) or "_target_" not in model:
        raise ConfigError(f"model: expected a mapping with _target_ (a LightningModule class), got {model!r}")
    if hydra is not None:
        model = model_arguments(model, hydra.runtime.choices.get("model"), list(hydra.overrides.task))
    job = JobConfig(
        model=model, data=data, recipe=recipe, trainer=trainer, logger=logger, sample=sample,
        **{key: container[key] for key in ("seed", "batch_size", "world_size", "spec", "evaluations", "threads_per_rank", "compile", "compile_options") if key in container},
    )
    for key in ("batch_size", "evaluations", "threads_per_rank"):
        _positive_int(key, getattr(job, key))
    _positive_int("seed", job.seed, minimum=0)
    if not isinstance(job.compile, bool):
        raise ConfigError(f"compile: expected true or false, got {job.compile!r}")
    if not isinstance(job.compile_options, dict):
        raise ConfigError(f"compile_options: expected a mapping of torch.compile arguments, got {job.compile_options!r}")
    if job.compile_options:
        from lightning_nnscaler.strategy import NnScalerStrategy

        if not job.compile:
            raise ConfigError(f"compile_options={job.compile_options}: compiles nothing without compile=true")
        try:
            NnScalerStrategy(recipe=job.recipe.name, compile=True, compile_options=job.compile_options)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    if job.world_size is not None:
        _positive_int("world_size", job.world_size)
    if job.spec is not None:
        _hardware_spec(job.spec)
    for key in ("seq_len", "max_files"):
        if getattr(data, key) is not None:
            _positive_int(f"data.{key}", getattr(data, key))
    for key in ("validation_batches", "train_samples", "validation_samples"):
        _positive_int(f"data.{key}", getattr(data, key))
    _positive_int("sample.tokens", sample.tokens, minimum=0)
    return job


def model_arguments(model: dict[str, Any], option: str | None, overrides: list[str]) -> dict[str, Any]:
    """The model node to instantiate: as composed, unless ``model._target_`` names another class than the
    model group's file (``conf/model/<option>.yaml``) does — the user's own LightningModule. Then the
    file's arguments (GPT's ``config``) are left out, as they belong to the file's class, and the
    constructor gets only the arguments the command line sets (``+model.hidden=32``), so a misspelt
    one still fails in the constructor, naming it."""
    path = CONF_DIR / "model" / f"{option}.yaml"
    if option is None or not path.is_file():
        return model
    group_file = OmegaConf.to_container(OmegaConf.load(path))
    assert isinstance(group_file, dict)
    if model["_target_"] == group_file.get("_target_"):
        return model
    from hydra.core.override_parser.overrides_parser import OverridesParser

    named = {override.key_or_group.split(".")[1] for override in OverridesParser.create().parse_overrides(overrides)
             if override.key_or_group.startswith("model.") and override.package is None}
    return {key: value for key, value in model.items() if key == "_target_" or key not in group_file or key in named}


def _recipe(section: Any) -> RecipeConfig:
    if not isinstance(section, dict) or "name" not in section:
        raise ConfigError(f"recipe: expected name and params, got {section!r}")
    try:
        spec = load_recipe(section["name"])
    except RecipeError as error:
        raise ConfigError(f"recipe.name={section['name']!r}: {error}") from None
    params = section.get("params") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"recipe.params: expected a mapping, got {params!r}")
    for key, value in params.items():
        if key not in spec.parameters:
            raise ConfigError(f"recipe.params.{key}: recipe {spec.name!r} has no parameter {key!r}; its parameters: {_names(spec)}")
        try:
            spec.parameters[key].check(spec.name, value)
        except RecipeError as error:
            raise ConfigError(f"recipe.params.{key}={value!r}: {error}") from None
    try:
        spec.check_parameters(params)
    except RecipeError as error:
        raise ConfigError(f"recipe.params: {error}") from None
    return RecipeConfig(name=spec.name, params=dict(params))


def _names(spec: RecipeSpec) -> str:
    return ", ".join(f"{name} ({parameter.type})" for name, parameter in spec.parameters.items()) or "none"


def _section(kind: type, container: dict[str, Any], key: str) -> Any:
    section = container.get(key)
    if not isinstance(section, dict):
        raise ConfigError(f"{key}: expected a mapping, got {section!r}")
    fields = set(inspect.signature(kind).parameters)
    unknown = sorted(set(section) - fields)
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}: not a {key} setting; the settings are: {', '.join(sorted(fields))}")
    return kind(**section)


def _trainer(section: Any) -> dict[str, Any]:
    import lightning as L

    if not isinstance(section, dict):
        raise ConfigError(f"trainer: expected a mapping of lightning.Trainer arguments, got {section!r}")
    accepted = set(inspect.signature(L.Trainer.__init__).parameters) - {"self", "strategy", "logger", "callbacks"}
    for key in section:
        if key not in accepted:
            raise ConfigError(f"trainer.{key}: not a lightning.Trainer argument (strategy, logger and callbacks are set by the app)")
    return dict(section)


def _hardware_spec(name: Any) -> None:
    from lightning_nnscaler.sim.specs import load_spec

    try:
        load_spec(str(name))
    except (FileNotFoundError, ValueError) as error:
        raise ConfigError(f"spec={name!r}: {error}") from None


def _choice(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r}: use one of {', '.join(allowed)}")


def _positive_int(key: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{key}={value!r}: expected an integer >= {minimum}")


def check_fit(job: JobConfig, module: Any, world_size: int) -> Any:
    """The recipe's layout for ``world_size`` ranks, after checking its pieces fit the devices and the
    model's attention heads.

    Raises:
        ConfigError: naming ``recipe.params`` / ``trainer.devices`` and the strategy's reason.
    """
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from lightning_nnscaler.strategy.planning import check_fits

    settings = ", ".join(f"recipe.params.{key}={value!r}" for key, value in job.recipe.params.items())
    where = f"recipe={job.recipe.name}" + (f" {settings}" if settings else "") + f" on {world_size} ranks (trainer.devices x trainer.num_nodes)"
    try:
        return check_fits(module, job.recipe.name, job.recipe.params, world_size)
    except (MisconfigurationException, ValueError) as error:
        raise ConfigError(f"{where}: {error}") from None
