"""AlphaFold2 Evoformer trunk with recycling and a distogram head (Jumper et al. 2021, Suppl. 1.6).

Algorithm numbers in docstrings refer to the AlphaFold2 supplementary information.
"""

from __future__ import annotations

from dataclasses import dataclass

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Evoformer", "EvoformerBatch", "EvoformerBlock", "EvoformerConfig"]

EvoformerBatch = tuple[Tensor, Tensor]
"""(msa_features (B, N_seq, N_res, msa_feat_dim) float32, target_bins (B, N_res, N_res) int64)."""


@dataclass(frozen=True, kw_only=True)
class EvoformerConfig:
    """Shape and training settings of `Evoformer`. Defaults are the AlphaFold2 trunk."""

    n_seq: int = 128
    """MSA depth N_seq: sequences per example (AlphaFold2 clusters: 128)."""
    n_res: int = 256
    """Residues per sequence N_res (AlphaFold2 training crop: 256)."""
    msa_feat_dim: int = 49
    """Channels of the input MSA features (AlphaFold2 msa_feat: 49)."""
    c_m: int = 256
    """MSA representation channels."""
    c_z: int = 128
    """Pair representation channels; also the triangle-multiplication hidden width."""
    c_opm: int = 32
    """Per-side channels of the outer product mean (its output is c_opm**2 before projection)."""
    msa_heads: int = 8
    """Heads of MSA row and column attention; must divide c_m."""
    pair_heads: int = 4
    """Heads of triangle attention; must divide c_z."""
    transition_factor: int = 4
    """Transition MLP inner width as a multiple of the channels."""
    blocks: int = 48
    """Number of Evoformer blocks."""
    recycles: int = 3
    """Trunk passes per step; all but the last run without gradients (AlphaFold2 trains with up to 3)."""
    max_relative_position: int = 32
    """Residue offsets are clipped to [-k, k] before the relative position embedding."""
    distogram_bins: int = 64
    """Distance bins predicted for every residue pair."""
    dropout: float = 0.0
    """Dropout probability on residual branches; 0 keeps runs deterministic."""
    learning_rate: float = 1e-3
    """AdamW learning rate."""

    def __post_init__(self) -> None:
        if self.c_m % self.msa_heads != 0:
            raise ValueError(f"EvoformerConfig.msa_heads ({self.msa_heads}) must divide c_m ({self.c_m}).")
        if self.c_z % self.pair_heads != 0:
            raise ValueError(f"EvoformerConfig.pair_heads ({self.pair_heads}) must divide c_z ({self.c_z}).")
        if self.recycles < 1:
            raise ValueError(f"EvoformerConfig.recycles must be at least 1, got {self.recycles}.")

    @classmethod
    def small(cls) -> EvoformerConfig:
        """Tiny config for tests: forward + backward in milliseconds on a CPU."""
        return cls(
            n_seq=4, n_res=8, msa_feat_dim=8, c_m=16, c_z=8, c_opm=4, msa_heads=2, pair_heads=2,
            blocks=2, recycles=2, max_relative_position=4, distogram_bins=8,
        )  # fmt: skip

    @classmethod
    def paper(cls) -> EvoformerConfig:
        """AlphaFold2 Evoformer (48 blocks, c_m 256, c_z 128): for simulation only."""
        return cls(n_seq=128, n_res=256, c_m=256, c_z=128, msa_heads=8, pair_heads=4, blocks=48, recycles=3)


class Transition(nn.Module):
    """Algorithms 9 and 15: LayerNorm, Linear -> ReLU -> Linear."""

    def __init__(self, channels: int, factor: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(channels)
        self.fc1 = nn.Linear(channels, factor * channels)
        self.fc2 = nn.Linear(factor * channels, channels)

    def forward(self, x: Tensor) -> Tensor:
        """(..., c) -> (..., c)."""
        return self.fc2(F.relu(self.fc1(self.norm(x))))


class GatedAttention(nn.Module):
    """Gated multi-head attention along dim -2 of (B, S, R, c), with an optional per-head bias."""

    def __init__(self, channels: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = channels // heads
        self.q_proj = nn.Linear(channels, channels, bias=False)
        self.k_proj = nn.Linear(channels, channels, bias=False)
        self.v_proj = nn.Linear(channels, channels, bias=False)
        self.gate = nn.Linear(channels, channels)
        self.out_proj = nn.Linear(channels, channels)

    def forward(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """x (B, S, R, c) already normalised, bias (B, nh, R, R) or None -> (B, S, R, c)."""
        B, S, R, C = x.shape
        q = self.q_proj(x).view(B, S, R, self.heads, self.head_dim).permute(0, 1, 3, 2, 4)  # (B, S, nh, R, hs)
        k = self.k_proj(x).view(B, S, R, self.heads, self.head_dim).permute(0, 1, 3, 2, 4)  # (B, S, nh, R, hs)
        v = self.v_proj(x).view(B, S, R, self.heads, self.head_dim).permute(0, 1, 3, 2, 4)  # (B, S, nh, R, hs)
        scores = (q * self.head_dim**-0.5) @ k.transpose(-2, -1)  # (B, S, nh, R, R)
        if bias is not None:
            scores = scores + bias.unsqueeze(1)  # + (B, 1, nh, R, R)
        y = F.softmax(scores, dim=-1) @ v  # (B, S, nh, R, hs)
        y = y.permute(0, 1, 3, 2, 4).reshape(B, S, R, C)  # (B, S, R, c)
        return self.out_proj(torch.sigmoid(self.gate(x)) * y)


class MSARowAttentionWithPairBias(nn.Module):
    """Algorithm 7: attention along residues within each MSA row, biased by the pair representation."""

    def __init__(self, c_m: int, c_z: int, heads: int) -> None:
        super().__init__()
        self.norm_m = nn.LayerNorm(c_m)
        self.norm_z = nn.LayerNorm(c_z)
        self.bias_proj = nn.Linear(c_z, heads, bias=False)
        self.attn = GatedAttention(c_m, heads)

    def forward(self, m: Tensor, z: Tensor) -> Tensor:
        """m (B, S, R, c_m), z (B, R, R, c_z) -> (B, S, R, c_m)."""
        bias = self.bias_proj(self.norm_z(z)).permute(0, 3, 1, 2)  # (B, nh, R, R)
        return self.attn(self.norm_m(m), bias)


class MSAColumnAttention(nn.Module):
    """Algorithm 8: attention along sequences within each MSA column."""

    def __init__(self, c_m: int, heads: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(c_m)
        self.attn = GatedAttention(c_m, heads)

    def forward(self, m: Tensor) -> Tensor:
        """(B, S, R, c_m) -> (B, S, R, c_m)."""
        columns = self.norm(m).transpose(1, 2)  # (B, R, S, c_m)
        return self.attn(columns).transpose(1, 2)


class OuterProductMean(nn.Module):
    """Algorithm 10: z_ij = Linear(mean_s a_si (x) b_sj), the MSA -> pair update."""

    def __init__(self, c_m: int, c_z: int, c_opm: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(c_m)
        self.left = nn.Linear(c_m, c_opm)
        self.right = nn.Linear(c_m, c_opm)
        self.out_proj = nn.Linear(c_opm * c_opm, c_z)

    def forward(self, m: Tensor) -> Tensor:
        """(B, S, R, c_m) -> (B, R, R, c_z)."""
        B, S, R, _ = m.shape
        m = self.norm(m)
        a = self.left(m)  # (B, S, R, c)
        b = self.right(m)  # (B, S, R, c)
        c = a.shape[-1]
        a = a.permute(0, 2, 3, 1).reshape(B, R * c, S)  # (B, R_i*c, S)
        b = b.reshape(B, S, R * c)  # (B, S, R_j*c)
        outer = (a @ b).view(B, R, c, R, c).permute(0, 1, 3, 2, 4)  # (B, R_i, R_j, c, c), summed over S
        return self.out_proj(outer.reshape(B, R, R, c * c) / S)


class TriangleMultiplication(nn.Module):
    """Algorithms 11 (outgoing: x_ij = sum_k a_ik b_jk) and 12 (incoming: x_ij = sum_k a_ki b_kj)."""

    def __init__(self, c_z: int, outgoing: bool) -> None:
        super().__init__()
        self.outgoing = outgoing
        self.norm_in = nn.LayerNorm(c_z)
        self.left_proj = nn.Linear(c_z, c_z)
        self.left_gate = nn.Linear(c_z, c_z)
        self.right_proj = nn.Linear(c_z, c_z)
        self.right_gate = nn.Linear(c_z, c_z)
        self.norm_out = nn.LayerNorm(c_z)
        self.out_proj = nn.Linear(c_z, c_z)
        self.out_gate = nn.Linear(c_z, c_z)

    def forward(self, z: Tensor) -> Tensor:
        """(B, R, R, c_z) -> (B, R, R, c_z)."""
        z = self.norm_in(z)
        a = torch.sigmoid(self.left_gate(z)) * self.left_proj(z)  # (B, R, R, c)
        b = torch.sigmoid(self.right_gate(z)) * self.right_proj(z)  # (B, R, R, c)
        if self.outgoing:
            x = a.permute(0, 3, 1, 2) @ b.permute(0, 3, 2, 1)  # (B, c, i, k) @ (B, c, k, j)
        else:
            x = a.permute(0, 3, 2, 1) @ b.permute(0, 3, 1, 2)  # (B, c, i, k) @ (B, c, k, j), from a_ki, b_kj
        x = x.permute(0, 2, 3, 1)  # (B, i, j, c)
        return torch.sigmoid(self.out_gate(z)) * self.out_proj(self.norm_out(x))


class TriangleAttention(nn.Module):
    """Algorithms 13 (around the starting node: along rows) and 14 (ending node: along columns)."""

    def __init__(self, c_z: int, heads: int, starting: bool) -> None:
        super().__init__()
        self.starting = starting
        self.norm = nn.LayerNorm(c_z)
        self.bias_proj = nn.Linear(c_z, heads, bias=False)
        self.attn = GatedAttention(c_z, heads)

    def forward(self, z: Tensor) -> Tensor:
        """(B, R, R, c_z) -> (B, R, R, c_z)."""
        x = z if self.starting else z.transpose(1, 2)  # ending node: attend along columns
        x = self.norm(x)
        bias = self.bias_proj(x).permute(0, 3, 1, 2)  # (B, nh, R, R)
        y = self.attn(x, bias)
        return y if self.starting else y.transpose(1, 2)


class EvoformerBlock(nn.Module):
    """Algorithm 6: MSA stack, communication (outer product mean), then pair stack; all residual."""

    def __init__(self, config: EvoformerConfig) -> None:
        super().__init__()
        c_m, c_z = config.c_m, config.c_z
        self.msa_row_attention = MSARowAttentionWithPairBias(c_m, c_z, config.msa_heads)
        self.msa_column_attention = MSAColumnAttention(c_m, config.msa_heads)
        self.msa_transition = Transition(c_m, config.transition_factor)
        self.outer_product_mean = OuterProductMean(c_m, c_z, config.c_opm)
        self.triangle_multiplication_outgoing = TriangleMultiplication(c_z, outgoing=True)
        self.triangle_multiplication_incoming = TriangleMultiplication(c_z, outgoing=False)
        self.triangle_attention_starting = TriangleAttention(c_z, config.pair_heads, starting=True)
        self.triangle_attention_ending = TriangleAttention(c_z, config.pair_heads, starting=False)
        self.pair_transition = Transition(c_z, config.transition_factor)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, m: Tensor, z: Tensor) -> tuple[Tensor, Tensor]:
        """m (B, S, R, c_m), z (B, R, R, c_z) -> updated (m, z)."""
        m = m + self.dropout(self.msa_row_attention(m, z))
        m = m + self.msa_column_attention(m)
        m = m + self.msa_transition(m)
        z = z + self.outer_product_mean(m)
        z = z + self.dropout(self.triangle_multiplication_outgoing(z))
        z = z + self.dropout(self.triangle_multiplication_incoming(z))
        z = z + self.dropout(self.triangle_attention_starting(z))
        z = z + self.dropout(self.triangle_attention_ending(z))
        return m, z + self.pair_transition(z)


class Evoformer(L.LightningModule):
    """Input embedding, recycled Evoformer trunk, distogram head."""

    def __init__(self, config: EvoformerConfig) -> None:
        super().__init__()
        self.config = config
        c_m, c_z, k = config.c_m, config.c_z, config.max_relative_position
        # Algorithm 3, simplified: the query sequence (MSA row 0) stands in for AlphaFold2's target_feat.
        self.msa_proj = nn.Linear(config.msa_feat_dim, c_m)
        self.target_proj = nn.Linear(config.msa_feat_dim, c_m)
        self.pair_left = nn.Linear(config.msa_feat_dim, c_z)
        self.pair_right = nn.Linear(config.msa_feat_dim, c_z)
        self.relative_position_embedding = nn.Embedding(2 * k + 1, c_z)  # = Linear over one-hot offsets
        residues = torch.arange(config.n_res)
        offsets = (residues[None, :] - residues[:, None]).clamp(-k, k) + k  # (R, R) in [0, 2k]
        self.register_buffer("relative_position_index", offsets)
        # Algorithm 32: recycled representations are LayerNorm'd and added to the next pass's embeddings.
        self.recycle_norm_m = nn.LayerNorm(c_m)
        self.recycle_norm_z = nn.LayerNorm(c_z)
        self.blocks = nn.ModuleList([EvoformerBlock(config) for _ in range(config.blocks)])
        self.distogram_head = nn.Linear(c_z, config.distogram_bins)

    def _trunk(self, msa_features: Tensor, previous_m0: Tensor, previous_z: Tensor) -> tuple[Tensor, Tensor]:
        """One pass: embed, add recycled state, run the blocks -> (m (B, S, R, c_m), z (B, R, R, c_z))."""
        R = msa_features.shape[2]
        target = msa_features[:, 0]  # (B, R, f): the query sequence
        m = self.msa_proj(msa_features) + self.target_proj(target).unsqueeze(1)  # (B, S, R, c_m)
        z = self.pair_left(target).unsqueeze(2) + self.pair_right(target).unsqueeze(1)  # (B, R, R, c_z)
        z = z + self.relative_position_embedding(self.relative_position_index[:R, :R])  # + (R, R, c_z)
        m0 = m[:, :1] + self.recycle_norm_m(previous_m0).unsqueeze(1)  # (B, 1, R, c_m)
        m = torch.cat([m0, m[:, 1:]], dim=1)  # recycled state updates only the query row
        z = z + self.recycle_norm_z(previous_z)
        for block in self.blocks:
            m, z = block(m, z)
        return m, z

    def forward(self, msa_features: Tensor) -> Tensor:
        """MSA features (B, S, R, msa_feat_dim) -> distogram logits (B, R, R, distogram_bins)."""
        B, _, R, _ = msa_features.shape
        m0 = msa_features.new_zeros(B, R, self.config.c_m)  # first pass recycles zeros, as AlphaFold2
        z = msa_features.new_zeros(B, R, R, self.config.c_z)
        for _ in range(self.config.recycles - 1):
            with torch.no_grad():
                m, z = self._trunk(msa_features, m0, z)
            m0 = m[:, 0]
        _, z = self._trunk(msa_features, m0, z)
        logits = self.distogram_head(z)  # (B, R, R, bins)
        return logits + logits.transpose(1, 2)  # distances are symmetric

    def compute_loss(self, batch: EvoformerBatch) -> Tensor:
        """Mean distogram cross-entropy over all residue pairs."""
        msa_features, target_bins = batch
        logits = self(msa_features)  # (B, R, R, bins)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target_bins.reshape(-1))

    def training_step(self, batch: EvoformerBatch, batch_idx: int) -> Tensor:
        """Return the training loss (and log it as "train_loss")."""
        loss = self.compute_loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: EvoformerBatch, batch_idx: int) -> Tensor:
        """Return the validation loss (and log it as "val_loss")."""
        loss = self.compute_loss(batch)
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW over all parameters at `config.learning_rate`."""
        return torch.optim.AdamW(self.parameters(), lr=self.config.learning_rate)

    def example_batch(self, batch_size: int, generator: torch.Generator | None = None) -> EvoformerBatch:
        """One-hot random residue features for every MSA position, and random distogram bins."""
        config = self.config
        residue_types = torch.randint(
            0, config.msa_feat_dim, (batch_size, config.n_seq, config.n_res), generator=generator
        )  # (B, S, R)
        msa_features = F.one_hot(residue_types, config.msa_feat_dim).float()  # (B, S, R, f)
        target_bins = torch.randint(
            0, config.distogram_bins, (batch_size, config.n_res, config.n_res), generator=generator
        )  # (B, R, R)
        return msa_features, target_bins
