"""``python -m lightning_nnscaler.train [key=value ...]``: the Hydra training app.

Composes ``conf/train.yaml`` (groups model, data, recipe, trainer, logger, experiment) with the
command line's overrides, e.g. ``recipe=coshard recipe.params.shards=2 trainer.devices=2``, and
trains under ``NnScalerStrategy``. Lightning's script launcher re-runs this same command for the
other ranks of the node (same overrides, same run folder, no Hydra output of their own), so every
rank composes the same config. A multirun (``-m recipe=dp,tp,coshard``) forks each job's ranks
from the sweep's process (its command line is the sweep) and ends with a comparison table
(``comparison.csv`` in the sweep folder).

Modules named in ``$LIGHTNING_NNSCALER_IMPORT`` (comma-separated; ``lightning-nnscaler --import`` sets
it) are imported first, in every rank: the recipes they register are ``recipe=<name>`` options.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning_nnscaler  # noqa: F401 - registers the strategies

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.types import RunMode  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from lightning_nnscaler.app.config import CONF_DIR, ConfigError, job_config  # noqa: E402
from lightning_nnscaler.app.recipes import register_catalog_recipes, register_user_recipes  # noqa: E402
from lightning_nnscaler.app.imports import IMPORT_ENVIRONMENT, ImportFailed, environment_modules, import_modules  # noqa: E402


def train(cfg: DictConfig) -> None:
    """The Hydra task: one training job (``app.job.run_job``)."""
    from lightning_nnscaler.app.job import print_log_records_once, run_job

    print_log_records_once()
    hydra_config = HydraConfig.get()
    run_dir = Path(hydra_config.runtime.output_dir)
    try:
        job = job_config(cfg, hydra_config)
        if hydra_config.mode != RunMode.MULTIRUN:
            run_job(job, run_dir)
            return
        # Lightning's script launcher would re-run the command line, which here is the whole sweep:
        # a sweep's ranks are forked from this process instead (a fresh process per rank, per job).
        try:
            run_job(job, run_dir, start_method="fork")
        except Exception as error:  # one failing job is a row of the comparison, not the end of the sweep
            (run_dir / "result.json").write_text(json.dumps({"recipe": job.recipe.name, "params": job.recipe.params, "error": str(error)[:300]}))
            print(f"job {hydra_config.job.num} failed: {error}", file=sys.stderr)
    except ConfigError as error:
        sys.exit(f"lightning_nnscaler.train: {error}")


def main() -> None:
    """Entry point: ``python -m lightning_nnscaler.train`` (and ``lightning-nnscaler train``)."""
    if not (CONF_DIR / "train.yaml").is_file():
        sys.exit("lightning_nnscaler.train: conf/train.yaml not found beside the package: run from a source checkout (pip install -e .)")
    try:
        import_modules(environment_modules(), source=f"{IMPORT_ENVIRONMENT}:")
    except ImportFailed as error:
        sys.exit(f"lightning_nnscaler.train: {error}")
    register_catalog_recipes(CONF_DIR)
    register_user_recipes()
    hydra.main(config_path=str(CONF_DIR), config_name="train", version_base=None)(train)()


if __name__ == "__main__":
    main()
