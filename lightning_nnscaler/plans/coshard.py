"""Co-shard (nnScaler, Lin et al. OSDI 2024): tensor parallelism cut finer than the devices, one
shard at a time, each shard recomputed in backward, so only one shard's activations are alive."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.plans.context import PlanContext
from lightning_nnscaler.plans.layout import DeviceGrid, RecipeLayout
from lightning_nnscaler.plans.megatron_tp import tensor_parallel
from lightning_nnscaler.plans.propagate import place
from lightning_nnscaler.plans.recompute import op_recompute


@dataclass(frozen=True, kw_only=True)
class CoshardConfig:
    """The co-shard recipe's parameters."""

    shards: int = field(default=4, metadata={"minimum": 1})
    """Pieces of each split per device (4: a quarter of the activations alive, nnScaler's example)."""
    recompute: bool = True
    """Give each (split stretch, device, shard) its own activation-recompute group (without it, co-shard saves no memory)."""


def coshard(graph: Graph, ctx: PlanContext, config: CoshardConfig) -> None:
    """Megatron splits (attention heads, FFN hidden) into ``shards × world_size`` pieces,
    ``shards`` consecutive pieces per device.

    With ``recompute``, each shard of each split stretch (an attention block, an MLP) is its own
    recompute group: group ``stretch * pieces + piece`` — distinct per (device, shard) — so a
    device keeps no shard's activations after forward and recomputes them one shard at a time.
    """
    if not isinstance(config.shards, int) or isinstance(config.shards, bool) or config.shards < 1:
        raise ValueError(f"coshard: shards must be a positive int, got {config.shards!r}")
    parts = config.shards * ctx.world_size
    walk = tensor_parallel(graph, parts)
    place(graph, walk, range(ctx.world_size))  # piece j -> device j // shards
    if config.recompute:
        for stretch, run in enumerate(walk.runs()):
            for pieces in run:
                for index, piece in enumerate(pieces):
                    op_recompute(graph, piece, stretch * parts + index)


def coshard_layout(world_size: int, params: dict[str, Any]) -> RecipeLayout:
    """One replica over every rank; heads cut in ``shards × world_size`` pieces."""
    shards = params["shards"]
    if shards < 1:
        raise ValueError(f"coshard: shards ({shards}) must be at least 1")
    return RecipeLayout(DeviceGrid.of(tp=world_size), shards * world_size, f"shards={shards} × {world_size} devices")
