"""Small tensor helpers that generated per-rank code calls (assembling pieces, recompute)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils import checkpoint as torch_checkpoint


def assemble(shape: tuple[int, ...], dtype: torch.dtype, fragments: list[tuple[torch.Tensor, tuple[slice, ...]]]) -> torch.Tensor:
    """A piece of ``shape`` built from fragments placed at their regions; overlapping value parts add.

    Differentiable: each fragment receives the gradient of its region.
    """
    device = fragments[0][0].device
    total: torch.Tensor | None = None
    for value, region in fragments:
        canvas = torch.zeros(shape, dtype=dtype, device=device)
        canvas[region] = value
        total = canvas if total is None else total + canvas
    assert total is not None
    return total


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A value part that holds nothing: part k > 0 of a whole tensor."""
    return torch.zeros(shape, dtype=dtype, device=device)


def checkpoint(function: Callable[..., Any], *arguments: torch.Tensor) -> Any:
    """Run ``function`` keeping only its inputs; its activations are recomputed during backward."""
    return torch_checkpoint.checkpoint(function, *arguments, use_reentrant=False)
