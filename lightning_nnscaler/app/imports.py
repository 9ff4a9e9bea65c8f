"""The user's own modules, importable as under ``python -m`` and imported in every process that trains.

``lightning-nnscaler --import my_recipes train ...`` imports ``my_recipes`` in the command and names it
in ``$LIGHTNING_NNSCALER_IMPORT`` for the training process (``python -m lightning_nnscaler.train``),
which imports it before composing its config; the ranks Lightning's launcher starts re-run that
command with the same environment, so they import it too. Only the standard library is imported here:
``lightning-nnscaler --help`` and ``recipes`` stay fast (``tests/unit/test_cli_startup.py``).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence

IMPORT_ENVIRONMENT = "LIGHTNING_NNSCALER_IMPORT"
"""Modules (comma-separated) the training app imports first, in every rank."""


class ImportFailed(ImportError):
    """A module named by ``--import`` (or ``$LIGHTNING_NNSCALER_IMPORT``) that is not found."""


def put_working_directory_on_path() -> None:
    """Put the current directory first on ``sys.path``, as ``python -m`` does (a console script gets
    its own folder instead), unless it is there already."""
    working_directory = os.getcwd()
    if not any(os.path.abspath(entry or os.curdir) == working_directory for entry in sys.path):
        sys.path.insert(0, working_directory)


def environment_modules() -> list[str]:
    """The modules named in ``$LIGHTNING_NNSCALER_IMPORT``, in order."""
    return [name.strip() for name in os.environ.get(IMPORT_ENVIRONMENT, "").split(",") if name.strip()]


def import_modules(names: Sequence[str], source: str = "--import") -> None:
    """Import ``names`` in order (each may register recipes); ``source`` is where they were named.

    Raises:
        ImportFailed: a module not found, naming it and where it was looked for.
    """
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name is None or not (name == error.name or name.startswith(error.name + ".")):
                raise  # a module the user's module imports in turn: its own traceback says where
            raise ImportFailed(
                f"{source} {name}: no module {error.name!r} in the current directory ({os.getcwd()}) or on sys.path; "
                "run from the folder that holds it or add that folder to PYTHONPATH"
            ) from None
