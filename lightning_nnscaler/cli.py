"""``lightning-nnscaler``: the command line.

    lightning-nnscaler recipes                 the recipe catalog, a line each
    lightning-nnscaler ckpt info DIR           a sharded checkpoint's plan and files
    lightning-nnscaler ckpt merge DIR OUT      a sharded checkpoint as one plain Lightning checkpoint file
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from lightning_nnscaler import checkpoint
from lightning_nnscaler.plans.catalog import list_recipes


def _recipes(arguments: argparse.Namespace) -> None:
    for spec in list_recipes():
        print(f"{spec.name:<10} {spec.summary}")


def _ckpt_info(arguments: argparse.Namespace) -> None:
    metadata = checkpoint.read_metadata(arguments.directory)
    shown = {key: metadata[key] for key in ("recipe", "recipe_params", "world_size", "plan_hash", "files")}
    print(json.dumps(shown, indent=1, sort_keys=True))


def _ckpt_merge(arguments: argparse.Namespace) -> None:
    checkpoint.merge(arguments.directory, arguments.output)
    print(f"wrote {arguments.output}: a plain Lightning checkpoint (loads with any strategy, e.g. strategy='auto')")


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``lightning-nnscaler``."""
    root = argparse.ArgumentParser(prog="lightning-nnscaler", description="lightning-nnscaler tools")
    commands = root.add_subparsers(dest="command", required=True)
    commands.add_parser("recipes", help="list the recipe catalog").set_defaults(run=_recipes)
    ckpt = commands.add_parser("ckpt", help="sharded checkpoints").add_subparsers(dest="ckpt_command", required=True)
    info = ckpt.add_parser("info", help="print a sharded checkpoint's plan and files")
    info.add_argument("directory")
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
        arguments.run(arguments)
    except checkpoint.CheckpointError as error:
        print(f"lightning-nnscaler: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
