"""Traced reference models for the recipe tests, traced once per process (tracing is the slow part)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.models.mbart import MBart, MBartConfig
from lightning_nnscaler.models.swin import Swin, SwinConfig
from lightning_nnscaler.plans import PlanContext, apply_recipe

# One layer, 32 heads of size 2, FFN 256, 32 tokens: splits into 8, 16 and 32 pieces divide it.
WIDE_GPT = GPTConfig(vocab_size=128, seq_len=32, hidden=64, layers=1, heads=32)
CONFIGS = {
    "gpt": (GPT, GPTConfig.small()),
    "gpt_wide": (GPT, WIDE_GPT),
    "swin": (Swin, SwinConfig.small()),
    "mbart": (MBart, MBartConfig.small()),
}


@dataclass(frozen=True)
class Traced:
    """A traced training step and the values of its inputs."""

    graph: lnn.Graph
    inputs: dict[str, torch.Tensor]

    def plan(self, recipe: str, world_size: int, **params) -> tuple[lnn.Graph, PlanContext]:
        """A planned copy of the graph and the recipe's context."""
        graph = self.graph.copy()
        return graph, apply_recipe(graph, recipe, world_size, **params)


@functools.lru_cache(maxsize=None)
def traced(model: str, batch_size: int) -> Traced:
    """``model`` (a key of CONFIGS) traced at ``batch_size``, with seeded weights and batch."""
    module_class, config = CONFIGS[model]
    torch.manual_seed(0)
    module = module_class(config)
    batch = module.example_batch(batch_size, torch.Generator().manual_seed(1))
    graph = lnn.trace(module, batch, step="training_step")
    return Traced(graph, lnn.bind_inputs(graph, module, batch, step="training_step"))
