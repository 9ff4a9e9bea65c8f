"""Small plans of one model for tests that compare one rank's planning with every rank's."""

from __future__ import annotations

import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.models.gpt import GPT, GPTConfig


def gpt_plan(recipe: str, world_size: int, rank: int | None = None, **params: int) -> lnn.Plan:
    """A two-layer GPT's training step planned with ``recipe`` for ``rank`` (None: every rank)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=8, hidden=16, layers=2, heads=2))
    model.log = lambda *args, **kwargs: None
    batch = model.example_batch(4, torch.Generator().manual_seed(0))
    return lnn.parallelize(model, batch, recipe, world_size, step="training_step", rank=rank, **params)
