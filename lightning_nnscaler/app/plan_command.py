"""``lightning-nnscaler plan [key=value ...]``: plan a composed config without starting any process.

Composes ``conf/train.yaml`` with the overrides (``model=gpt recipe=tp world_size=8``), builds the
model and an example batch, parallelizes it and prints the per-rank table (``Plan.explain``), the
simulated step on the ``spec`` hardware (``prediction_spec``: per rank busy, communication and idle
milliseconds and peak memory, then ``Prediction.summary``) and each rank's parameter count, and
writes the per-rank code (``Plan.save_code``) and ``plan.png`` (memory bars and the simulated timeline).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from hydra.utils import instantiate
from omegaconf import open_dict
from omegaconf.errors import OmegaConfBaseException

from lightning_nnscaler.app.config import CONF_DIR, ConfigError, JobConfig, check_fit, job_config
from lightning_nnscaler.app.recipes import register_catalog_recipes, register_user_recipes
from lightning_nnscaler.parallelize import Plan, parallelize
from lightning_nnscaler.sim import predict
from lightning_nnscaler.sim.specs import FALLBACK_GPU_SPEC, spec_for_device


def rank_parameter_counts(plan: Plan) -> list[int]:
    """Parameter elements each rank holds (the boxes of its parameter pieces)."""
    return [
        sum(math.prod(stop - start for start, stop in local.box) for local in program.inputs if local.role == "parameter")
        for program in plan.program.ranks
    ]


def prediction_spec(job: JobConfig) -> tuple[str, str]:
    """The hardware spec the plan is predicted on, and why: ``spec`` when set; else that of the devices
    ``trainer`` would train on, as the strategy picks it (``sim.spec_for_device``): the measured ``cpu``
    spec for ``accelerator=cpu`` (or ``auto`` without a GPU), this machine's GPU's spec, or
    ``FALLBACK_GPU_SPEC`` when there is no GPU here to name."""
    if job.spec is not None:
        return job.spec, f"spec={job.spec}"
    accelerator = job.trainer.get("accelerator", "auto")
    has_gpu = torch.cuda.is_available()
    if accelerator == "cpu" or (accelerator == "auto" and not has_gpu):
        return "cpu", f"trainer.accelerator={accelerator}"
    if has_gpu:
        spec, note = spec_for_device(torch.cuda.get_device_name(0))
        return spec, note or f"trainer.accelerator={accelerator} on this machine's {torch.cuda.get_device_name(0)}"
    return FALLBACK_GPU_SPEC, f"trainer.accelerator={accelerator} and no GPU here to name: spec=NAME picks another"


class _Quiet:
    """``progress`` without a terminal: status updates go nowhere."""

    def update(self, message: str) -> None:
        """Ignore the update."""


@contextlib.contextmanager
def progress(message: str) -> Iterator[Any]:
    """A spinner with ``message`` (and ``.update(message)``) on stderr while the block runs, drawn with
    rich (the progress library Lightning's RichProgressBar uses) when stderr is a terminal."""
    try:
        from rich.console import Console
    except ImportError:  # rich is optional
        yield _Quiet()
        return
    console = Console(stderr=True)
    if not console.is_terminal:
        yield _Quiet()
        return
    with console.status(message) as status:
        yield status


def plan_command(overrides: Sequence[str], output: Path) -> Plan:
    """Plan the composed config for ``world_size`` ranks (default ``trainer.devices x trainer.num_nodes``);
    print the tables, write the code under ``output/<plan hash>/`` and the picture to ``output/plan.png``.

    Raises:
        ConfigError: a setting that cannot work, naming the key.
    """
    register_catalog_recipes(CONF_DIR)
    register_user_recipes()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            composed = compose("train", overrides=list(overrides), return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as error:  # unknown group option, key or value syntax
        raise ConfigError(f"overrides {' '.join(overrides)}: {str(error).splitlines()[0]}") from None
    hydra = composed.hydra
    with open_dict(composed):
        del composed["hydra"]
    job = job_config(composed, hydra)
    world_size = job.world_size or job.devices_world_size
    if world_size is None:
        raise ConfigError("world_size is null and trainer.devices is not a count: pass world_size=N")
    with progress(f"building {job.model['_target_'].rsplit('.', 1)[-1]}") as status:
        module = instantiate(job.model)
        replicas = check_fit(job, module, world_size).data_parallel
        batch = module.example_batch(job.batch_size * replicas, torch.Generator().manual_seed(job.seed))
        plan = parallelize(module, batch, job.recipe.name, world_size, step="training_step", progress=status.update, **job.recipe.params)
        spec, reason = prediction_spec(job)
        status.update(f"simulating a step on {spec}")
        prediction = predict(plan, spec, record=True)
    print(plan.explain())
    print(f"\nhardware spec {spec!r} ({reason}):")
    print(prediction.table())
    print("parameters per rank (elements):")
    for rank, count in enumerate(rank_parameter_counts(plan)):
        print(f"  rank {rank}: {count} parameters")
    code = plan.save_code(output)
    from lightning_nnscaler.draw import draw_plan

    picture = draw_plan(plan, output / "plan.png", prediction=prediction)
    print(f"per-rank code: {code}")
    print(f"plan picture: {picture}")
    return plan
