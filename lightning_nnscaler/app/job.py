"""One training job: build the model, data, strategy, logger and Trainer from a ``JobConfig``, fit,
then (rank 0) draw the plan, print a generated sample and write ``result.json`` in the run folder."""

from __future__ import annotations

import json
import logging
import math
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate

import lightning_nnscaler as lnn

import lightning as L  # noqa: E402 - after lightning_nnscaler (keeps torchvision importable)
from lightning.pytorch.callbacks import Callback  # noqa: E402

from lightning_nnscaler.app.config import ConfigError, JobConfig, LoggerConfig, check_fit  # noqa: E402
from lightning_nnscaler.app.data import build_loaders  # noqa: E402
from lightning_nnscaler.app.sample import generate  # noqa: E402

RESULT_FILE = "result.json"
PLAN_PICTURE = "plan.png"


class JobRecord(Callback):
    """Losses, step times and each rank's peak memory of a fit (peak memory gathered on every rank at the end)."""

    def __init__(self) -> None:
        self.train_losses: list[float] = []
        self.validation_losses: list[tuple[int, float]] = []
        self.step_seconds: list[float] = []
        self.peak_memory_bytes: list[int] = []
        self._started = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self._started = time.perf_counter()  # the strategy reports its planning stages itself

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.step_seconds.append(time.perf_counter() - self._started)
        if len(self.step_seconds) == 1 and trainer.global_rank == 0 and trainer.strategy.plan is not None:
            print(f"planned and ran the first step in {self.step_seconds[0]:.1f} s: plan {trainer.strategy.plan.plan_hash[:12]}")
        loss = trainer.callback_metrics.get("train_loss")
        if loss is not None:
            self.train_losses.append(float(loss))

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loss = trainer.callback_metrics.get("val_loss")
        if loss is not None and not trainer.sanity_checking:
            self.validation_losses.append((trainer.global_step, float(loss)))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        peak = torch.tensor([float(_peak_memory_bytes(pl_module.device))], dtype=torch.float64)
        gathered = trainer.strategy.all_gather(peak) if trainer.world_size > 1 else peak
        self.peak_memory_bytes = [int(value) for value in gathered.reshape(-1).tolist()]


def _peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated CUDA memory on a GPU; on CPU the process's peak resident set (Linux reports KiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def print_log_records_once() -> None:
    """Lightning's log lines once each, in Hydra's format (and in the job's log file).

    ``import lightning`` gives the ``lightning`` logger a console handler of its own ("INFO: ...") and
    leaves it propagating to the root logger, where Hydra's job logging prints every record again
    ("[time][name][INFO] - ..."). ``lightning.pytorch`` itself keeps a handler only when the root
    logger has none ("if root logger has handlers, propagate messages up and let root logger process
    them"): with Hydra's root handlers in place, the records go to them alone."""
    if not logging.getLogger().handlers:
        return
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if type(handler) is logging.StreamHandler:  # Lightning's console handlers (not a file a user added)
                logger.removeHandler(handler)
        logger.propagate = True


def build_logger(config: LoggerConfig, run_dir: Path) -> Any:
    """The Lightning logger of ``logger.kind``, writing under ``run_dir`` (False for ``none``)."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger

    if config.kind == "wandb":
        return WandbLogger(project=config.project, save_dir=str(run_dir), offline=config.offline)
    if config.kind == "csv":
        return CSVLogger(str(run_dir), name="csv")
    if config.kind == "tensorboard":
        return TensorBoardLogger(str(run_dir), name="tensorboard")
    return False


def run_job(job: JobConfig, run_dir: Path, *, start_method: str = "popen") -> None:
    """Train ``job``; rank 0 then draws the plan, prints a sample and writes ``run_dir/result.json``
    (``JobReport``). ``start_method`` is the strategy's: ``popen`` (Lightning re-runs this command per
    rank) or ``fork`` (ranks forked from this process: a sweep's jobs, whose command line is the sweep).

    Raises:
        ConfigError: a setting that does not fit the model or the devices, naming the key.
    """
    started = time.perf_counter()
    torch.set_num_threads(job.threads_per_rank)
    L.seed_everything(job.seed, verbose=False)
    module = instantiate(job.model)
    world_size = job.devices_world_size
    if job.world_size is not None and world_size is not None and job.world_size != world_size:
        raise ConfigError(f"world_size={job.world_size} differs from trainer.devices x trainer.num_nodes = {world_size}: drop world_size")
    replicas = check_fit(job, module, world_size).data_parallel if world_size else 1
    loaders = build_loaders(job.data, module, job.batch_size, replicas, job.seed)
    trainer_args = dict(job.trainer)
    accumulate = trainer_args.get("accumulate_grad_batches", 1)
    global_batch = job.batch_size * replicas * accumulate if isinstance(accumulate, int) and world_size else None  # samples per optimizer step, all ranks
    max_steps = int(trainer_args.get("max_steps") or loaders.steps_per_epoch)
    trainer_args.setdefault("val_check_interval", max(1, min(max_steps // job.evaluations, loaders.steps_per_epoch)))
    record = JobRecord()
    trainer = L.Trainer(
        strategy=lnn.NnScalerStrategy(recipe=job.recipe.name, start_method=start_method, compile=job.compile,
                                      compile_options=job.compile_options or None, **job.recipe.params),
        logger=build_logger(job.logger, run_dir), callbacks=[record, JobReport(job, run_dir, record, started, global_batch)],
        default_root_dir=str(run_dir), enable_checkpointing=False, num_sanity_val_steps=0, **trainer_args,
    )
    trainer.fit(module, loaders.train, loaders.validation)


class JobReport(Callback):
    """At the end of the fit, on rank 0 (the full module holds the trained weights): the plan picture
    (logged to W&B when it logs), a generated sample, and ``result.json`` with what ``JobRecord`` measured
    and ``global_batch``: the samples one optimizer step consumes over all ranks (``batch_size`` x
    data-parallel replicas x ``accumulate_grad_batches``)."""

    def __init__(self, job: JobConfig, run_dir: Path, record: JobRecord, started: float, global_batch: int | None) -> None:
        self.job = job
        self.global_batch = global_batch
        self.run_dir = run_dir
        self.record = record
        self.started = started

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank != 0:
            return
        job, record = self.job, self.record
        plan = trainer.strategy.plan
        predicted = getattr(trainer.strategy, "predicted_step", None)
        picture = _draw(plan, self.run_dir, trainer.logger, predicted)
        result: dict[str, Any] = {
            "recipe": job.recipe.name, "params": job.recipe.params, "world_size": trainer.world_size, "global_batch": self.global_batch,
            "plan_hash": plan.plan_hash if plan is not None else None,
            "steps": len(record.train_losses),
            "step_time_s": statistics.median(record.step_seconds[1:] or record.step_seconds),  # the first step plans
            "predicted_step_time_s": predicted.step_seconds if predicted is not None else None,
            "predicted_spec": predicted.spec if predicted is not None else None,
            "peak_memory_bytes": record.peak_memory_bytes,
            "first_train_loss": record.train_losses[0] if record.train_losses else math.nan,
            "final_train_loss": record.train_losses[-1] if record.train_losses else math.nan,
            "validation_losses": record.validation_losses,
            "plan_picture": str(picture) if picture else None,
        }
        if job.data.kind == "stdlib_text" and job.sample.tokens:
            result["sample"] = generate(pl_module, job.sample)
            print(f"\n--- sample (prompt {job.sample.prompt!r}, {job.sample.tokens} bytes, temperature {job.sample.temperature}) ---")
            print(result["sample"])
            print("--- end of sample ---")
        result["wall_s"] = time.perf_counter() - self.started
        (self.run_dir / RESULT_FILE).write_text(json.dumps(result, indent=1))
        _report(result, self.run_dir)


def _draw(plan: Any, run_dir: Path, logger: Any, predicted: Any) -> Path | None:
    """The plan picture beside the run, its timeline simulated on the spec the strategy predicted the
    logged step on (``predicted``: ``step_timing.PredictedStep``; None when the simulator failed, and
    then no picture); logged to W&B as an image, with the memory table, when W&B logs."""
    if plan is None:
        return None
    from lightning.pytorch.loggers import WandbLogger

    from lightning_nnscaler.draw import draw_plan, memory_rows
    from lightning_nnscaler.explain import ROW_KEYS

    picture = draw_plan(plan, run_dir / PLAN_PICTURE, predicted.spec) if predicted is not None else None
    if isinstance(logger, WandbLogger):
        if picture is not None:
            logger.log_image(key="plan", images=[str(picture)], caption=[f"recipe {plan.recipe} on {plan.world_size} ranks"])
        columns = ["rank", *ROW_KEYS]
        rows = [[rank, *(row[key] for key in ROW_KEYS)] for rank, row in enumerate(memory_rows(plan))]
        logger.log_table(key="plan_memory_bytes", columns=columns, data=rows)
    return picture


def _report(result: dict[str, Any], run_dir: Path) -> None:
    validation = result["validation_losses"]
    if validation:
        print(f"validation loss {validation[0][1]:.3f} (step {validation[0][0]}) -> {validation[-1][1]:.3f} (step {validation[-1][0]})")
    print(f"train loss {result['first_train_loss']:.3f} -> {result['final_train_loss']:.3f} over {result['steps']} steps; "
          f"step {result['step_time_s'] * 1e3:.0f} ms{_predicted(result)}; plan {str(result['plan_hash'])[:12]}")
    print(f"run folder: {run_dir} (plan picture: {result['plan_picture']})")


def _predicted(result: dict[str, Any]) -> str:
    seconds = result["predicted_step_time_s"]
    return f" (predicted {seconds * 1e3:.0f} ms on {result['predicted_spec']})" if seconds is not None else ""
