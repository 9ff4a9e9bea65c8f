"""``lightning-nnscaler``: the command line.

    lightning-nnscaler recipes                 the recipe catalog, a line each (with its parameters)
    lightning-nnscaler train [key=value ...]   the Hydra training app (python -m lightning_nnscaler.train); -m sweeps
    lightning-nnscaler plan [--out DIR] [key=value ...]
                                               plan a config (e.g. model=gpt recipe=tp world_size=8) in this process:
                                               per-rank table, per-rank code and plan.png under DIR (default: plan)
    lightning-nnscaler --import MODULE ...     import MODULE first (it registers your own recipes), in every process that
                                               trains too (train passes it on in $LIGHTNING_NNSCALER_IMPORT)
    lightning-nnscaler ckpt info DIR           a sharded checkpoint's plan, files and leftovers (or a plain file's summary)
    lightning-nnscaler ckpt info --verify DIR  the same, after reading and checking every file (sizes, hashes, save tokens)
    lightning-nnscaler ckpt merge DIR OUT      a sharded checkpoint as one plain Lightning checkpoint file (every file checked)
    lightning-nnscaler ckpt merge --format safetensors [--max-shard-size 5GB] [--strip-prefix model.] DIR OUT
                                               the model weights as a Hugging Face safetensors directory, tensor by tensor

A damaged checkpoint exits with status 2 and one line naming the file, what is wrong and what to do.
As under ``python -m``, modules in the current directory are importable (``--import my_recipes``,
``model._target_=my_module.MyModule``): the console script puts it first on ``sys.path``.

Each command imports what it needs when it runs: ``--help`` and ``recipes`` import neither torch nor
Lightning (``tests/unit/test_cli_startup.py``), so they answer at once.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from lightning_nnscaler.app.imports import IMPORT_ENVIRONMENT, ImportFailed, environment_modules, import_modules, put_working_directory_on_path

CATALOG_MODULE = "lightning_nnscaler.plans.catalog"
MERGE_DEFAULT_SHARD_SIZE = "5GB"  # checkpoint.export.DEFAULT_MAX_SHARD_SIZE (not imported: --help imports no torch)
ONE_LINE_ERRORS = (
    ("lightning_nnscaler.checkpoint.integrity", "CheckpointError"), (CATALOG_MODULE, "RecipeError"), ("lightning_nnscaler.app.config", "ConfigError"),
)
"""``(module, class)`` of the errors reported in one line with exit status 2."""


def recipe_line(spec: Any) -> str:
    """One line of ``lightning-nnscaler recipes``: name, summary and ``[parameter: type = default, ...]``
    of a catalog ``RecipeSpec`` or a ``RecipeSummary`` (the same attributes)."""
    parameters = ", ".join(
        f"{p.name}: {p.type}" + (" | None" if p.nullable else "") + (" (required)" if p.required else f" = {p.default!r}") for p in spec.parameters.values()
    )
    return f"{spec.name:<10} {spec.summary}" + (f" [{parameters}]" if parameters else "")


def catalog_specs() -> list[Any]:
    """The recipes ``lightning-nnscaler recipes`` lists, sorted by name.

    Only the catalog knows recipes registered with ``register_recipe``, and registering one imports
    it: when it is imported, it answers. Otherwise the catalog holds the built-ins alone, and their
    files and sources answer without importing the plan functions (nor torch)."""
    if CATALOG_MODULE not in sys.modules:
        from lightning_nnscaler.recipes.summaries import UnreadableRecipe, built_in_summaries

        try:
            return built_in_summaries()
        except UnreadableRecipe:
            pass
    from lightning_nnscaler.plans.catalog import list_recipes

    return list_recipes()


def _recipes(arguments: argparse.Namespace) -> None:
    for spec in catalog_specs():
        print(recipe_line(spec))


def _ckpt_info(arguments: argparse.Namespace) -> None:
    from lightning_nnscaler import checkpoint

    print(json.dumps(checkpoint.describe(arguments.directory, verify=arguments.verify), indent=1, sort_keys=True, default=str))


def _ckpt_merge(arguments: argparse.Namespace) -> None:
    from lightning_nnscaler import checkpoint

    if arguments.format == "safetensors":
        try:
            written = checkpoint.export_safetensors(
                arguments.directory, arguments.output, max_shard_size=arguments.max_shard_size, strip_prefix=arguments.strip_prefix
            )
        except ValueError as error:  # a --max-shard-size that is no size
            raise checkpoint.CheckpointError(f"--max-shard-size: {error}") from None
        print(f"wrote {arguments.output}: the model weights as Hugging Face safetensors ({', '.join(written)})")
        return
    if arguments.strip_prefix or arguments.max_shard_size != MERGE_DEFAULT_SHARD_SIZE:
        print("lightning-nnscaler: --strip-prefix and --max-shard-size apply to --format safetensors only", file=sys.stderr)
        raise SystemExit(2)
    checkpoint.merge(arguments.directory, arguments.output)
    print(f"wrote {arguments.output}: a plain Lightning checkpoint (loads with any strategy, e.g. strategy='auto')")


def _train(arguments: argparse.Namespace) -> None:
    """Forward the Hydra overrides to ``python -m lightning_nnscaler.train`` (its exit status becomes ours),
    with the ``--import`` modules in ``$LIGHTNING_NNSCALER_IMPORT``: the training process and its ranks
    import them too (they register the recipes the config names)."""
    environment = dict(os.environ)
    modules = environment_modules()
    modules += [name for name in arguments.imports if name not in modules]
    if modules:
        environment[IMPORT_ENVIRONMENT] = ",".join(modules)
    completed = subprocess.run([sys.executable, "-m", "lightning_nnscaler.train", *arguments.overrides], env=environment, check=False)
    if completed.returncode:
        raise SystemExit(completed.returncode)


def _plan(arguments: argparse.Namespace) -> None:
    from lightning_nnscaler.app.plan_command import plan_command

    plan_command(arguments.overrides, Path(arguments.out))


def split_hydra_command(argv: Sequence[str]) -> tuple[list[str], list[str]] | None:
    """``(options before the command, [command, *rest])`` when the command is ``train`` or ``plan``, whose
    Hydra overrides (``-m``, ``key=value``) argparse must not read; None otherwise."""
    index = 0
    while index < len(argv) and argv[index].startswith("--import"):
        index += 1 if "=" in argv[index] else 2
    if index < len(argv) and argv[index] in ("train", "plan"):
        return list(argv[:index]), list(argv[index:])
    return None


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``lightning-nnscaler``."""
    root = argparse.ArgumentParser(prog="lightning-nnscaler", description="lightning-nnscaler tools")
    root.add_argument(
        "--import", dest="imports", action="append", default=[], metavar="MODULE",
        help="import MODULE before the command (e.g. a module that calls lightning_nnscaler.register_recipe); repeatable",
    )
    commands = root.add_subparsers(dest="command", required=True)
    commands.add_parser("recipes", help="list the recipe catalog").set_defaults(run=_recipes)
    train = commands.add_parser("train", help="the Hydra training app: lightning-nnscaler train [-m] [key=value ...]")
    train.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. recipe=coshard recipe.params.shards=2 trainer.devices=2")
    train.set_defaults(run=_train)
    plan = commands.add_parser("plan", help="plan a config without starting processes: table, per-rank code, plan.png")
    plan.add_argument("--out", default="plan", help="folder for the per-rank code and plan.png (default: plan)")
    plan.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=gpt recipe=tp world_size=8")
    plan.set_defaults(run=_plan)
    ckpt = commands.add_parser("ckpt", help="sharded checkpoints").add_subparsers(dest="ckpt_command", required=True)
    info = ckpt.add_parser("info", help="print a sharded checkpoint's plan, files and leftovers, or a plain checkpoint's summary")
    info.add_argument("directory")
    info.add_argument("--verify", action="store_true", help="read every file and check its size, content hash and save token")
    info.set_defaults(run=_ckpt_info)
    merge = ckpt.add_parser("merge", help="write a sharded checkpoint as one plain Lightning checkpoint file, or its weights as safetensors")
    merge.add_argument("directory", help="the sharded checkpoint directory (e.g. epoch=0-step=10.ckpt)")
    merge.add_argument("output", help="the file to write, e.g. model.ckpt; with --format safetensors a new (or empty) directory")
    merge.add_argument(
        "--format", choices=("ckpt", "safetensors"), default="ckpt",
        help="ckpt (default): the whole Lightning checkpoint (optimizer states too) in one file; safetensors: the model weights "
        "alone as a Hugging Face directory (model.safetensors, or shards and model.safetensors.index.json), streamed tensor by tensor",
    )
    merge.add_argument("--max-shard-size", default=MERGE_DEFAULT_SHARD_SIZE, help="safetensors: the largest shard, e.g. 5GB (default), 500MB, 2GiB")
    merge.add_argument("--strip-prefix", default=None, help="safetensors: remove this prefix from every key, e.g. 'model.' for an HF model held as self.model")
    merge.set_defaults(run=_ckpt_merge)
    return root


def _one_line_errors() -> tuple[type[Exception], ...]:
    """The classes of ``ONE_LINE_ERRORS`` whose modules are imported (a module not imported raised none)."""
    return tuple(getattr(sys.modules[module], name) for module, name in ONE_LINE_ERRORS if module in sys.modules)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit status (2 with a message for a bad checkpoint)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    split = split_hydra_command(argv)
    if split is not None and split[1][0] == "train":  # Hydra's own flags (-m, --cfg, ...) pass through untouched
        arguments = parser().parse_args([*split[0], "train"])
        arguments.overrides = split[1][1:]
    else:
        arguments = parser().parse_args(argv)
    put_working_directory_on_path()
    try:
        import_modules(arguments.imports)
        arguments.run(arguments)
    except Exception as error:
        if isinstance(error, (ImportFailed, *_one_line_errors())):
            print(f"lightning-nnscaler: {error}", file=sys.stderr)
            return 2
        if isinstance(error, OSError):  # e.g. the output of `ckpt merge` cannot be written
            print(f"lightning-nnscaler: {error.filename or ''}: {error.strerror or error}: check the path and its permissions", file=sys.stderr)
            return 2
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
