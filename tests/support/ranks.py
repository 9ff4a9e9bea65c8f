"""Rank processes for the tests that train on real gloo ranks."""

from __future__ import annotations

from typing import Any, Callable

from lightning_nnscaler.launch import launch

RANK_PRELOAD = ("lightning_nnscaler", "lightning.pytorch")
"""What every rank imports (the package first: it fixes torchvision before Lightning imports it)."""


def launch_ranks(fn: Callable[..., Any], world_size: int, *args: Any, **options: Any) -> list[Any]:
    """``lightning_nnscaler.launch.launch`` with its ranks forked from one server that imported
    `RANK_PRELOAD` once for the whole session: a spawned rank spends seconds of CPU importing Lightning
    (9 s on the CI runner), and the suite starts dozens of ranks."""
    return launch(fn, world_size, *args, preload=RANK_PRELOAD, **options)
