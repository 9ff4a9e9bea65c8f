"""GPT: a decoder-only pre-LN transformer (GPT-2 / GPT-3 architecture), nanoGPT style."""

from __future__ import annotations

import math
from dataclasses import dataclass

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_nnscaler.models._common import MLP, MultiHeadAttention, init_transformer_weights

__all__ = ["GPT", "GPTBatch", "GPTConfig"]

GPTBatch = tuple[Tensor, Tensor]
"""(tokens (B, T) int64, targets (B, T) int64): targets are tokens shifted left by one."""


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape and training settings of `GPT`. Defaults are GPT-2 124M."""

    vocab_size: int = 50257
    """Number of token ids (GPT-2 BPE: 50257)."""
    seq_len: int = 1024
    """Maximum sequence length: rows of the learned position embedding."""
    hidden: int = 768
    """Model width (d_model)."""
    layers: int = 12
    """Number of transformer blocks."""
    heads: int = 12
    """Attention heads per block; must divide `hidden`."""
    ffn_hidden: int | None = None
    """MLP inner width; None means 4 * hidden, as in GPT-2/3."""
    dropout: float = 0.0
    """Dropout probability (embeddings, attention, residual branches); 0 keeps runs deterministic."""
    learning_rate: float = 1e-3
    """AdamW learning rate."""

    def __post_init__(self) -> None:
        if self.hidden % self.heads != 0:
            raise ValueError(f"GPTConfig.hidden ({self.hidden}) must be divisible by GPTConfig.heads ({self.heads}).")
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", 4 * self.hidden)

    @classmethod
    def small(cls) -> GPTConfig:
        """Tiny config for tests: forward + backward in milliseconds on a CPU."""
        return cls(vocab_size=128, seq_len=16, hidden=32, layers=2, heads=4)

    @classmethod
    def gpt2_124m(cls) -> GPTConfig:
        """GPT-2 small shapes: 124M parameters with a tied head, 163M with this model's untied one."""
        return cls(vocab_size=50257, seq_len=1024, hidden=768, layers=12, heads=12)

    @classmethod
    def paper(cls) -> GPTConfig:
        """GPT-3 6.7B (Brown et al. 2020, Table 2.1; 6.9B here with the untied head): for simulation only."""
        return cls(vocab_size=50257, seq_len=2048, hidden=4096, layers=32, heads=32)


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.ffn_hidden is not None  # set by __post_init__
        self.ln_1 = nn.LayerNorm(config.hidden)
        self.attn = MultiHeadAttention(config.hidden, config.heads, config.dropout)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.ln_2 = nn.LayerNorm(config.hidden)
        self.mlp = MLP(config.hidden, config.ffn_hidden, config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        """(B, T, C) -> (B, T, C)."""
        x = x + self.attn_dropout(self.attn(self.ln_1(x), is_causal=True))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(L.LightningModule):
    """Decoder-only language model: token + position embedding, pre-LN blocks, untied LM head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.hidden)
        self.position_embedding = nn.Embedding(config.seq_len, config.hidden)
        self.embedding_dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.layers)])
        self.ln_f = nn.LayerNorm(config.hidden)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        self.apply(init_transformer_weights)
        # GPT-2: scale residual-branch output projections by 1/sqrt(2 * layers).
        for block in self.blocks:
            nn.init.normal_(block.attn.out_proj.weight, std=0.02 / math.sqrt(2 * config.layers))
            nn.init.normal_(block.mlp.fc2.weight, std=0.02 / math.sqrt(2 * config.layers))

    def forward(self, tokens: Tensor) -> Tensor:
        """Token ids (B, T) -> next-token logits (B, T, vocab_size)."""
        T = tokens.shape[1]
        positions = torch.arange(T, device=tokens.device)  # (T,)
        x = self.token_embedding(tokens) + self.position_embedding(positions)  # (B, T, C)
        x = self.embedding_dropout(x)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, V)

    def compute_loss(self, batch: GPTBatch) -> Tensor:
        """Mean next-token cross-entropy over the batch."""
        tokens, targets = batch
        logits = self(tokens)  # (B, T, V)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    def training_step(self, batch: GPTBatch, batch_idx: int) -> Tensor:
        """Return the training loss (and log it as "train_loss")."""
        loss = self.compute_loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: GPTBatch, batch_idx: int) -> Tensor:
        """Return the validation loss (and log it as "val_loss")."""
        loss = self.compute_loss(batch)
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW over all parameters at `config.learning_rate`."""
        return torch.optim.AdamW(self.parameters(), lr=self.config.learning_rate)

    def example_batch(self, batch_size: int, generator: torch.Generator | None = None) -> GPTBatch:
        """Random token sequences of length `seq_len` and their left-shifted targets."""
        sequence = torch.randint(
            0, self.config.vocab_size, (batch_size, self.config.seq_len + 1), generator=generator
        )  # (B, T + 1)
        return sequence[:, :-1].contiguous(), sequence[:, 1:].contiguous()
