"""Swin Transformer for image classification (Liu et al. 2021), shifted-window attention."""

from __future__ import annotations

from dataclasses import dataclass

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_nnscaler.models._common import MLP, init_transformer_weights

__all__ = ["Swin", "SwinBatch", "SwinConfig"]

SwinBatch = tuple[Tensor, Tensor]
"""(images (B, 3, H, W) float32, labels (B,) int64)."""


@dataclass(frozen=True, kw_only=True)
class SwinConfig:
    """Shape and training settings of `Swin`. Defaults are Swin-T (Liu et al. 2021, Table 1)."""

    image_size: int = 224
    """Height and width of the (square) input images."""
    in_channels: int = 3
    """Input image channels."""
    patch_size: int = 4
    """Side of the non-overlapping patches embedded as tokens (Conv2d stride)."""
    embed_dim: int = 96
    """Token width of stage 1; each patch merging doubles it."""
    depths: tuple[int, ...] = (2, 2, 6, 2)
    """Swin blocks per stage."""
    heads: tuple[int, ...] = (3, 6, 12, 24)
    """Attention heads per stage; heads[i] must divide embed_dim * 2**i."""
    window_size: int = 7
    """Side of the attention windows, in tokens; clipped to the stage resolution when larger."""
    mlp_ratio: int = 4
    """MLP inner width as a multiple of the token width."""
    num_classes: int = 1000
    """Number of output classes."""
    dropout: float = 0.0
    """Dropout probability on residual branches; 0 keeps runs deterministic."""
    drop_path: float = 0.0
    """Stochastic depth: the probability that a sample skips a block's residual branches, rising
    linearly from 0 at the first block to this value at the last (timm's ``drop_path_rate``)."""
    learning_rate: float = 1e-3
    """AdamW learning rate."""

    def __post_init__(self) -> None:
        if len(self.depths) != len(self.heads):
            raise ValueError(f"SwinConfig.depths {self.depths} and SwinConfig.heads {self.heads} need equal length.")
        if self.image_size % self.patch_size != 0:
            raise ValueError(f"SwinConfig.image_size must be a multiple of patch_size ({self.patch_size}).")
        for stage, resolution in enumerate(self.stage_resolutions):
            window = min(self.window_size, resolution)
            if resolution % window != 0:
                raise ValueError(
                    f"Stage {stage} resolution {resolution} is not a multiple of SwinConfig.window_size "
                    f"({self.window_size}); pick image_size/patch_size/window_size that tile evenly."
                )
            if (self.embed_dim * 2**stage) % self.heads[stage] != 0:
                raise ValueError(f"SwinConfig.heads[{stage}] must divide the stage width {self.embed_dim * 2**stage}.")

    @property
    def stage_resolutions(self) -> tuple[int, ...]:
        """Token grid side of each stage (halved by every patch merging)."""
        first = self.image_size // self.patch_size
        return tuple(first // 2**stage for stage in range(len(self.depths)))

    @classmethod
    def small(cls) -> SwinConfig:
        """Tiny config for tests: 16x16 then 8x8 tokens, 4x4 windows."""
        return cls(
            image_size=32, patch_size=2, window_size=4, embed_dim=16, depths=(2, 2), heads=(1, 2), num_classes=10
        )

    @classmethod
    def paper(cls) -> SwinConfig:
        """Billions-of-parameters Swin, the scale of the nnScaler paper: for simulation only."""
        return cls(
            image_size=224, patch_size=4, window_size=7, embed_dim=512, depths=(2, 2, 42, 2), heads=(16, 32, 64, 128),
            num_classes=1000,
        )  # fmt: skip


def window_partition(x: Tensor, window: int) -> Tensor:
    """(B, H, W, C) -> (B * nW, window * window, C), windows in row-major order."""
    B, H, W, C = x.shape
    x = x.view(B, H // window, window, W // window, window, C)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, window * window, C)


def window_reverse(windows: Tensor, window: int, H: int, W: int) -> Tensor:
    """(B * nW, window * window, C) -> (B, H, W, C); inverse of `window_partition`."""
    C = windows.shape[-1]
    x = windows.view(-1, H // window, W // window, window, window, C)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, H, W, C)


def relative_position_index(window: int) -> Tensor:
    """(N, N) int64 index into the ((2w-1)^2, heads) bias table, N = window * window."""
    coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij"))  # (2, w, w)
    coords = coords.flatten(1)  # (2, N)
    relative = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0)  # (N, N, 2), each in [-(w-1), w-1]
    return (relative[..., 0] + window - 1) * (2 * window - 1) + (relative[..., 1] + window - 1)


def shifted_window_mask(resolution: int, window: int, shift: int) -> Tensor:
    """(nW, N, N) additive mask: -100 between tokens that the cyclic shift made neighbours."""
    region = torch.zeros(1, resolution, resolution, 1)
    spans = (slice(0, -window), slice(-window, -shift), slice(-shift, None))
    label = 0
    for rows in spans:
        for cols in spans:
            region[:, rows, cols, :] = label
            label += 1
    region_windows = window_partition(region, window).squeeze(-1)  # (nW, N)
    different = region_windows[:, None, :] != region_windows[:, :, None]  # (nW, N, N)
    return torch.zeros(different.shape).masked_fill(different, -100.0)


class WindowAttention(nn.Module):
    """Multi-head self-attention inside each window, with a learned relative position bias."""

    def __init__(self, dim: int, heads: int, window: int) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * window - 1) ** 2, heads))
        nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)
        self.register_buffer("relative_position_index", relative_position_index(window))

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        """x (B * nW, N, C), mask (nW, N, N) or None -> (B * nW, N, C)."""
        B_, N, C = x.shape
        q = self.q_proj(x).view(B_, N, self.heads, self.head_dim).transpose(1, 2)  # (B*nW, nh, N, hs)
        k = self.k_proj(x).view(B_, N, self.heads, self.head_dim).transpose(1, 2)  # (B*nW, nh, N, hs)
        v = self.v_proj(x).view(B_, N, self.heads, self.head_dim).transpose(1, 2)  # (B*nW, nh, N, hs)
        scores = (q * self.head_dim**-0.5) @ k.transpose(-2, -1)  # (B*nW, nh, N, N)
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)]  # (N*N, nh)
        scores = scores + bias.view(N, N, self.heads).permute(2, 0, 1).unsqueeze(0)  # + (1, nh, N, N)
        if mask is not None:
            windows = mask.shape[0]
            scores = scores.view(-1, windows, self.heads, N, N) + mask[None, :, None]  # (B, nW, nh, N, N)
            scores = scores.view(B_, self.heads, N, N)
        y = F.softmax(scores, dim=-1) @ v  # (B*nW, nh, N, hs)
        return self.out_proj(y.transpose(1, 2).reshape(B_, N, C))


class SwinBlock(nn.Module):
    """Pre-LN block: (shifted) window attention, then MLP, both residual."""

    def __init__(self, dim: int, heads: int, resolution: int, window: int, shift: int, config: SwinConfig, drop_path: float = 0.0) -> None:
        super().__init__()
        self.drop_path = drop_path
        self.resolution = resolution
        self.window = window
        self.shift = shift
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, heads, window)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, config.mlp_ratio * dim, config.dropout)
        self.dropout = nn.Dropout(config.dropout)
        mask = shifted_window_mask(resolution, window, shift) if shift > 0 else None
        self.register_buffer("attn_mask", mask)

    def forward(self, x: Tensor) -> Tensor:
        """(B, H*W, C) -> (B, H*W, C)."""
        B, L, C = x.shape
        H = W = self.resolution
        y = self.norm1(x).view(B, H, W, C)
        if self.shift > 0:
            y = torch.roll(y, shifts=(-self.shift, -self.shift), dims=(1, 2))
        y = self.attn(window_partition(y, self.window), self.attn_mask)  # (B*nW, N, C)
        y = window_reverse(y, self.window, H, W)  # (B, H, W, C)
        if self.shift > 0:
            y = torch.roll(y, shifts=(self.shift, self.shift), dims=(1, 2))
        x = x + drop_path(self.dropout(y.reshape(B, L, C)), self.drop_path, self.training)
        return x + drop_path(self.mlp(self.norm2(x)), self.drop_path, self.training)


def drop_path(x: Tensor, probability: float, training: bool) -> Tensor:
    """Stochastic depth (timm's ``drop_path``): zero whole samples of a residual branch with
    ``probability``, scaling the kept ones by ``1 / (1 - probability)``; identity outside training."""
    if probability == 0.0 or not training:
        return x
    keep = 1.0 - probability
    kept = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)  # (B, 1, ..., 1)
    if keep > 0.0:
        kept.div_(keep)
    return x * kept


class PatchMerging(nn.Module):
    """Concatenate each 2x2 token neighbourhood (4C) and project to 2C: halves the grid side."""

    def __init__(self, dim: int, resolution: int) -> None:
        super().__init__()
        self.resolution = resolution
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """(B, H*W, C) -> (B, H/2 * W/2, 2C)."""
        B, _, C = x.shape
        x = x.view(B, self.resolution, self.resolution, C)
        quadrants = [x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]]  # 4 x (B, H/2, W/2, C)
        x = torch.cat(quadrants, dim=-1)  # (B, H/2, W/2, 4C)
        return self.reduction(self.norm(x.view(B, -1, 4 * C)))


class Swin(L.LightningModule):
    """Swin Transformer classifier: patch embedding, stages of Swin blocks, mean pool, linear head."""

    def __init__(self, config: SwinConfig) -> None:
        super().__init__()
        self.config = config
        dim = config.embed_dim
        self.patch_embed = nn.Conv2d(config.in_channels, dim, kernel_size=config.patch_size, stride=config.patch_size)
        self.patch_norm = nn.LayerNorm(dim)
        stages: list[nn.Module] = []
        layout = zip(config.depths, config.heads, config.stage_resolutions, strict=True)
        rates = iter(torch.linspace(0, config.drop_path, sum(config.depths)).tolist())
        for stage, (depth, heads, resolution) in enumerate(layout):
            window = min(config.window_size, resolution)
            shift = window // 2 if resolution > window else 0  # one window covers the grid: nothing to shift
            blocks: list[nn.Module] = [  # odd blocks attend over shifted windows
                SwinBlock(dim, heads, resolution, window, shift if index % 2 else 0, config, next(rates)) for index in range(depth)
            ]
            if stage < len(config.depths) - 1:
                blocks.append(PatchMerging(dim, resolution))
                dim *= 2
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.ModuleList(stages)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, config.num_classes)
        self.apply(init_transformer_weights)

    def forward(self, images: Tensor) -> Tensor:
        """Images (B, 3, H, W) -> class logits (B, num_classes)."""
        x = self.patch_embed(images)  # (B, C, H/p, W/p)
        x = self.patch_norm(x.flatten(2).transpose(1, 2))  # (B, L, C)
        for stage in self.stages:
            x = stage(x)
        x = self.norm(x).mean(dim=1)  # (B, C_last)
        return self.head(x)  # (B, num_classes)

    def compute_loss(self, batch: SwinBatch) -> Tensor:
        """Mean classification cross-entropy over the batch."""
        images, labels = batch
        return F.cross_entropy(self(images), labels)

    def training_step(self, batch: SwinBatch, batch_idx: int) -> Tensor:
        """Return the training loss (and log it as "train_loss")."""
        loss = self.compute_loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: SwinBatch, batch_idx: int) -> Tensor:
        """Return the validation loss (and log it as "val_loss")."""
        loss = self.compute_loss(batch)
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW over all parameters at `config.learning_rate`."""
        return torch.optim.AdamW(self.parameters(), lr=self.config.learning_rate)

    def example_batch(self, batch_size: int, generator: torch.Generator | None = None) -> SwinBatch:
        """Standard-normal images and uniformly random labels."""
        size = self.config.image_size
        images = torch.randn(batch_size, self.config.in_channels, size, size, generator=generator)
        labels = torch.randint(0, self.config.num_classes, (batch_size,), generator=generator)
        return images, labels
