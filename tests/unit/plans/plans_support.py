"""Traced reference models for the recipe tests, traced once per process (tracing is the slow part)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

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


class PreLNAttentionBlock(nn.Module):
    """A pre-LN block around nn.MultiheadAttention, as the PyTorch docs write one; causal through
    ``attn_mask`` and ``is_causal`` when ``causal``."""

    def __init__(self, hidden: int, heads: int, causal: bool = True) -> None:
        super().__init__()
        self.causal = causal
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = self.ln1(x)
        if self.causal:
            mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
            attended = self.attn(normed, normed, normed, need_weights=False, attn_mask=mask, is_causal=True)[0]
        else:
            attended = self.attn(normed, normed, normed, need_weights=False)[0]
        x = x + attended
        return x + self.mlp(self.ln2(x))


class MultiheadAttentionLM(nn.Module):
    """nn.Embedding, two pre-LN nn.MultiheadAttention blocks, an LM head and cross-entropy."""

    def __init__(self, hidden: int = 32, heads: int = 8, vocab: int = 64, causal: bool = True) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, hidden)
        self.blocks = nn.Sequential(PreLNAttentionBlock(hidden, heads, causal), PreLNAttentionBlock(hidden, heads, causal))
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int = 0) -> torch.Tensor:
        tokens, targets = batch
        logits = self.head(self.ln(self.blocks(self.embedding(tokens))))
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
