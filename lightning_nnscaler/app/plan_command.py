"""``lightning-nnscaler plan [key=value ...]``: plan a composed config without starting any process.

Composes ``conf/train.yaml`` with the overrides (``model=gpt recipe=tp world_size=8``), builds the
model and an example batch, parallelizes it and prints the per-rank table (``Plan.explain``), the
simulated step on the ``spec`` hardware (``prediction_spec``: per rank busy, communication and idle
milliseconds and peak memory, then ``Prediction.summary``) and each rank's parameter count, and
writes the per-rank code (``Plan.save_code``) and ``plan.png`` (memory bars and the simulated timeline).

``lightning-nnscaler plan analytic=gpt3-175b spec=h100 world_size=1024`` plans a paper-scale transformer by
its shape instead (``analytic_plan_command``): no model is built and no graph traced; ``sim.cluster`` searches
dp × tp × pp plans with their recompute, ZeRO-1, sequence parallelism and interleaving on the spec's large-run
terms and prints the chosen plan, its predicted step and memory, what the prediction assumed, and the runners-up.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import replace
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
from lightning_nnscaler.plan import Plan, parallelize
from lightning_nnscaler.sim import predict
from lightning_nnscaler.sim.analytic import TransformerShape
from lightning_nnscaler.sim.cluster import ClusterOutcome, search_cluster
from lightning_nnscaler.sim.specs import FALLBACK_GPU_SPEC, spec_for_device

ANALYTIC_SHAPES = {
    # Brown et al. 2020, Table 2.1; the batch of Narayanan et al. 2021's 175B-class runs (1536 sequences)
    "gpt3-175b": TransformerShape(embeddings=True),
    "gpt3-6.7b": TransformerShape(layers=32, hidden=4096, seq_len=2048, vocab=50257, heads=32, global_batch=512, embeddings=True),
    # Dubey et al. 2024, Table 3 (126 layers rounded to 128 so that 2..32 stages divide them; blocks of 12·h²) and
    # Table 4 (16M-token batches of 8192 tokens)
    "llama3-405b": TransformerShape(layers=128, hidden=16384, seq_len=8192, vocab=128256, heads=128, global_batch=2048, embeddings=True),
}
"""The shapes ``analytic=NAME`` plans (shape keys such as ``layers=`` or ``global_batch=`` override them)."""
SHAPE_KEYS = ("layers", "hidden", "seq_len", "vocab", "heads", "global_batch")


def rank_parameter_counts(plan: Plan) -> list[int]:
    """Parameter elements each rank holds (the boxes of its parameter pieces)."""
    return [
        sum(math.prod(stop - start for start, stop in local.box) for local in program.inputs if local.role == "parameter")
        for program in plan.materialized.ranks
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


def plan_command(overrides: Sequence[str], output: Path) -> Plan | None:
    """Plan the composed config for ``world_size`` ranks (default ``trainer.devices x trainer.num_nodes``);
    print the tables, write the code under ``output/<plan hash>/`` and the picture to ``output/plan.png``.

    Raises:
        ConfigError: a setting that cannot work, naming the key.
    """
    if any(override.startswith("analytic=") for override in overrides):
        analytic_plan_command(overrides)
        return None
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


def analytic_plan_command(overrides: Sequence[str]) -> ClusterOutcome:
    """Search plans of the shape ``analytic=NAME`` names (``ANALYTIC_SHAPES``, its ``SHAPE_KEYS`` overridable) for
    ``world_size`` ranks of ``spec`` (default h100) within ``memory_limit_gb`` (default the spec's memory), trying
    ``virtual_stages`` (default ``1,2,4``) with the gradient reduction overlapped (``overlap=false``: not); print
    the chosen plan, its predicted step, memory and throughput, its basis, and the ten fastest fitting plans.

    Raises:
        ConfigError: an unknown key or shape name, a missing ``world_size``, or no plan that fits.
    """
    settings = dict(override.split("=", 1) for override in overrides)
    unknown = set(settings) - {"analytic", "spec", "world_size", "memory_limit_gb", "virtual_stages", "overlap", *SHAPE_KEYS}
    if unknown or settings["analytic"] not in ANALYTIC_SHAPES or "world_size" not in settings:
        raise ConfigError(f"analytic plan: give analytic={'|'.join(ANALYTIC_SHAPES)} world_size=N [spec=h100] [memory_limit_gb=G] "
                          f"[virtual_stages=1,2,4] [overlap=true] [{'=N, '.join(SHAPE_KEYS)}=N]; got {' '.join(overrides)}")
    shape = replace(ANALYTIC_SHAPES[settings["analytic"]], **{key: int(settings[key]) for key in SHAPE_KEYS if key in settings})
    spec, world_size = settings.get("spec", "h100"), int(settings["world_size"])
    limit = float(settings["memory_limit_gb"]) if "memory_limit_gb" in settings else None
    chunks = tuple(int(value) for value in settings.get("virtual_stages", "1,2,4").split(","))
    outcomes, seconds = search_cluster(shape, spec, world_size, memory_limit_gb=limit, virtual_stages=chunks,
                                       overlap_grad_reduce=settings.get("overlap", "true").lower() == "true", prune=True)
    fitting = [outcome for outcome in outcomes if not outcome.reason]
    if not fitting:
        raise ConfigError(f"no plan of {settings['analytic']} on {world_size} × {spec} fits: {outcomes[0].reason}")
    best = fitting[0]
    flops = 3 * shape.global_batch * shape.layers * (24 * shape.seq_len * shape.hidden**2 + 4 * shape.seq_len**2 * shape.hidden)
    print(f"{settings['analytic']} ({shape.layers} blocks, hidden {shape.hidden}, {shape.seq_len} tokens, batch {shape.global_batch}) "
          f"on {world_size} × {spec}: {len(outcomes)} plans simulated in {seconds:.1f} s")
    print(f"chosen: {best.plan}")
    print(f"  predicted step {best.step_seconds:.3f} s, peak memory {best.peak_bytes / 1e9:.1f} GB per GPU, "
          f"{flops / (world_size * best.step_seconds) / 1e12:.0f} TFLOP/s per GPU (model FLOPs of the blocks)")
    print(f"  assumed: {best.basis}")
    print("fastest fitting plans:")
    for outcome in fitting[:10]:
        print(f"  {outcome.step_seconds:>9.3f} s  {outcome.peak_bytes / 1e9:>6.1f} GB  {outcome.plan}")
    return best
