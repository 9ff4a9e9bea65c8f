"""The package's one base exception: every error lightning-nnscaler raises on purpose is an ``NnScalerError``.

Each concrete error also keeps the built-in base that says what kind of failure it is (``ValueError`` for
bad input, ``RuntimeError`` for a failure while running, ...), so ``except ValueError`` still catches a
bad recipe parameter, and ``except lightning_nnscaler.NnScalerError`` catches everything the package raises.
"""

from __future__ import annotations


class NnScalerError(Exception):
    """Base class of every error lightning-nnscaler raises on purpose."""
