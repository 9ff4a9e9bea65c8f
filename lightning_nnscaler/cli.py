"""``lightning-nnscaler``: the command line.

    lightning-nnscaler recipes                 the recipe catalog, a line each (with its parameters)
    lightning-nnscaler --import MODULE ...     import MODULE first (it registers your own recipes)
    lightning-nnscaler ckpt info DIR           a sharded checkpoint's plan, files and leftovers (or a plain file's summary)
    lightning-nnscaler ckpt info --verify DIR  the same, after reading and checking every file (sizes, hashes, save tokens)
    lightning-nnscaler ckpt merge DIR OUT      a sharded checkpoint as one plain Lightning checkpoint file (every file checked)

A damaged checkpoint exits with status 2 and one line naming the file, what is wrong and what to do.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Optional, Sequence

from lightning_nnscaler import checkpoint
from lightning_nnscaler.plans.catalog import RecipeError, list_recipes


def _recipes(arguments: argparse.Namespace) -> None:
    for spec in list_recipes():
        parameters = ", ".join(
            f"{p.name}: {p.type}" + (" | None" if p.nullable else "") + (" (required)" if p.required else f" = {p.default!r}") for p in spec.parameters.values()
        )
        print(f"{spec.name:<10} {spec.summary}" + (f" [{parameters}]" if parameters else ""))


def _ckpt_info(arguments: argparse.Namespace) -> None:
    print(json.dumps(checkpoint.describe(arguments.directory, verify=arguments.verify), indent=1, sort_keys=True, default=str))


def _ckpt_merge(arguments: argparse.Namespace) -> None:
    checkpoint.merge(arguments.directory, arguments.output)
    print(f"wrote {arguments.output}: a plain Lightning checkpoint (loads with any strategy, e.g. strategy='auto')")


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``lightning-nnscaler``."""
    root = argparse.ArgumentParser(prog="lightning-nnscaler", description="lightning-nnscaler tools")
    root.add_argument(
        "--import", dest="imports", action="append", default=[], metavar="MODULE",
        help="import MODULE before the command (e.g. a module that calls lightning_nnscaler.register_recipe); repeatable",
    )
    commands = root.add_subparsers(dest="command", required=True)
    commands.add_parser("recipes", help="list the recipe catalog").set_defaults(run=_recipes)
    ckpt = commands.add_parser("ckpt", help="sharded checkpoints").add_subparsers(dest="ckpt_command", required=True)
    info = ckpt.add_parser("info", help="print a sharded checkpoint's plan, files and leftovers, or a plain checkpoint's summary")
    info.add_argument("directory")
    info.add_argument("--verify", action="store_true", help="read every file and check its size, content hash and save token")
    info.set_defaults(run=_ckpt_info)
    merge = ckpt.add_parser("merge", help="write a sharded checkpoint as one plain Lightning checkpoint file")
    merge.add_argument("directory", help="the sharded checkpoint directory (e.g. epoch=0-step=10.ckpt)")
    merge.add_argument("output", help="the file to write, e.g. model.ckpt")
    merge.set_defaults(run=_ckpt_merge)
    return root


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit status (2 with a message for a bad checkpoint)."""
    arguments = parser().parse_args(argv)
    try:
        for module in arguments.imports:
            importlib.import_module(module)
        arguments.run(arguments)
    except (checkpoint.CheckpointError, RecipeError) as error:
        print(f"lightning-nnscaler: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # e.g. the output of `ckpt merge` cannot be written
        print(f"lightning-nnscaler: {error.filename or ''}: {error.strerror or error}: check the path and its permissions", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
