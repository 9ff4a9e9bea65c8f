"""mBART: a pre-LN encoder-decoder transformer over a very large multilingual vocabulary."""

from __future__ import annotations

import math
from dataclasses import dataclass

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_nnscaler.models._common import MLP, MultiHeadAttention, init_transformer_weights

__all__ = ["MBart", "MBartBatch", "MBartConfig"]

MBartBatch = tuple[Tensor, Tensor, Tensor]
"""(source_tokens (B, S), target_input_tokens (B, T), target_labels (B, T)), all int64."""


@dataclass(frozen=True, kw_only=True)
class MBartConfig:
    """Shape and training settings of `MBart`. Defaults are mBART-large (Liu et al. 2020)."""

    vocab_size: int = 250027
    """Number of token ids, shared by source and target (mBART-25/50 SentencePiece: 250027)."""
    seq_len: int = 1024
    """Maximum source and target length: rows of each learned position embedding."""
    hidden: int = 1024
    """Model width (d_model)."""
    encoder_layers: int = 12
    """Number of encoder blocks."""
    decoder_layers: int = 12
    """Number of decoder blocks."""
    heads: int = 16
    """Attention heads in every attention layer; must divide `hidden`."""
    ffn_hidden: int | None = None
    """MLP inner width; None means 4 * hidden (mBART-large: 4096)."""
    dropout: float = 0.0
    """Dropout probability (embeddings, attention, residual branches); 0 keeps runs deterministic."""
    learning_rate: float = 1e-3
    """AdamW learning rate."""

    def __post_init__(self) -> None:
        if self.hidden % self.heads != 0:
            raise ValueError(
                f"MBartConfig.hidden ({self.hidden}) must be divisible by MBartConfig.heads ({self.heads})."
            )
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", 4 * self.hidden)

    @classmethod
    def small(cls) -> MBartConfig:
        """Tiny config for tests: forward + backward in milliseconds on a CPU."""
        return cls(vocab_size=256, seq_len=16, hidden=32, encoder_layers=2, decoder_layers=2, heads=4)

    @classmethod
    def paper(cls) -> MBartConfig:
        """mBART-large shapes: for simulation only.

        867M parameters here: mBART-large's 610M plus this model's untied 256M-parameter LM head.
        """
        return cls(
            vocab_size=250027, seq_len=1024, hidden=1024, encoder_layers=12, decoder_layers=12, heads=16,
            ffn_hidden=4096,
        )  # fmt: skip


class EncoderLayer(nn.Module):
    """Pre-LN encoder block: bidirectional self-attention, then MLP."""

    def __init__(self, config: MBartConfig) -> None:
        super().__init__()
        assert config.ffn_hidden is not None  # set by __post_init__
        self.self_attn_norm = nn.LayerNorm(config.hidden)
        self.self_attn = MultiHeadAttention(config.hidden, config.heads, config.dropout)
        self.mlp_norm = nn.LayerNorm(config.hidden)
        self.mlp = MLP(config.hidden, config.ffn_hidden, config.dropout)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        """(B, S, C) -> (B, S, C)."""
        x = x + self.dropout(self.self_attn(self.self_attn_norm(x)))
        return x + self.mlp(self.mlp_norm(x))


class DecoderLayer(nn.Module):
    """Pre-LN decoder block: causal self-attention, cross-attention to the encoder, then MLP."""

    def __init__(self, config: MBartConfig) -> None:
        super().__init__()
        assert config.ffn_hidden is not None  # set by __post_init__
        self.self_attn_norm = nn.LayerNorm(config.hidden)
        self.self_attn = MultiHeadAttention(config.hidden, config.heads, config.dropout)
        self.cross_attn_norm = nn.LayerNorm(config.hidden)
        self.cross_attn = MultiHeadAttention(config.hidden, config.heads, config.dropout)
        self.mlp_norm = nn.LayerNorm(config.hidden)
        self.mlp = MLP(config.hidden, config.ffn_hidden, config.dropout)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, memory: Tensor) -> Tensor:
        """x (B, T, C), encoder output memory (B, S, C) -> (B, T, C)."""
        x = x + self.dropout(self.self_attn(self.self_attn_norm(x), is_causal=True))
        x = x + self.dropout(self.cross_attn(self.cross_attn_norm(x), context=memory))
        return x + self.mlp(self.mlp_norm(x))


class MBart(L.LightningModule):
    """Encoder-decoder translation model: one token embedding shared by encoder and decoder, untied LM head."""

    def __init__(self, config: MBartConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding_scale = math.sqrt(config.hidden)  # mBART scales token embeddings by sqrt(d_model)
        self.token_embedding = nn.Embedding(config.vocab_size, config.hidden)
        self.encoder_positions = nn.Embedding(config.seq_len, config.hidden)
        self.decoder_positions = nn.Embedding(config.seq_len, config.hidden)
        self.encoder_embedding_norm = nn.LayerNorm(config.hidden)
        self.decoder_embedding_norm = nn.LayerNorm(config.hidden)
        self.embedding_dropout = nn.Dropout(config.dropout)
        self.encoder_layers = nn.ModuleList([EncoderLayer(config) for _ in range(config.encoder_layers)])
        self.decoder_layers = nn.ModuleList([DecoderLayer(config) for _ in range(config.decoder_layers)])
        self.encoder_norm = nn.LayerNorm(config.hidden)
        self.decoder_norm = nn.LayerNorm(config.hidden)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        self.apply(init_transformer_weights)

    def _embed(self, tokens: Tensor, positions: nn.Embedding, norm: nn.LayerNorm) -> Tensor:
        """Token ids (B, L) -> normalised token + position embeddings (B, L, C)."""
        position_ids = torch.arange(tokens.shape[1], device=tokens.device)  # (L,)
        x = self.token_embedding(tokens) * self.embedding_scale + positions(position_ids)  # (B, L, C)
        return self.embedding_dropout(norm(x))

    def encode(self, source_tokens: Tensor) -> Tensor:
        """Source ids (B, S) -> encoder output (B, S, C)."""
        x = self._embed(source_tokens, self.encoder_positions, self.encoder_embedding_norm)
        for layer in self.encoder_layers:
            x = layer(x)
        return self.encoder_norm(x)

    def decode(self, target_input_tokens: Tensor, memory: Tensor) -> Tensor:
        """Target ids (B, T) and encoder output (B, S, C) -> logits (B, T, vocab_size)."""
        x = self._embed(target_input_tokens, self.decoder_positions, self.decoder_embedding_norm)
        for layer in self.decoder_layers:
            x = layer(x, memory)
        return self.lm_head(self.decoder_norm(x))  # (B, T, V)

    def forward(self, source_tokens: Tensor, target_input_tokens: Tensor) -> Tensor:
        """Source ids (B, S) and teacher-forced target ids (B, T) -> logits (B, T, vocab_size)."""
        return self.decode(target_input_tokens, self.encode(source_tokens))

    def compute_loss(self, batch: MBartBatch) -> Tensor:
        """Mean next-token cross-entropy of the target sequence."""
        source_tokens, target_input_tokens, target_labels = batch
        logits = self(source_tokens, target_input_tokens)  # (B, T, V)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), target_labels.view(-1))

    def training_step(self, batch: MBartBatch, batch_idx: int) -> Tensor:
        """Return the training loss (and log it as "train_loss")."""
        loss = self.compute_loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: MBartBatch, batch_idx: int) -> Tensor:
        """Return the validation loss (and log it as "val_loss")."""
        loss = self.compute_loss(batch)
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW over all parameters at `config.learning_rate`."""
        return torch.optim.AdamW(self.parameters(), lr=self.config.learning_rate)

    def example_batch(self, batch_size: int, generator: torch.Generator | None = None) -> MBartBatch:
        """Random source ids, and a random target sequence split into decoder input and labels."""
        vocab, length = self.config.vocab_size, self.config.seq_len
        source_tokens = torch.randint(0, vocab, (batch_size, length), generator=generator)  # (B, S)
        target = torch.randint(0, vocab, (batch_size, length + 1), generator=generator)  # (B, T + 1)
        return source_tokens, target[:, :-1].contiguous(), target[:, 1:].contiguous()
