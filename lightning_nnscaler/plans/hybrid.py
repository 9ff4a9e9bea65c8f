"""Data × tensor parallelism: Megatron tensor parallelism inside each data-parallel replica."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.plans.context import PlanContext
from lightning_nnscaler.plans.layout import DeviceGrid, RecipeLayout
from lightning_nnscaler.plans.dp import split_batch
from lightning_nnscaler.plans.megatron_tp import megatron_choice, tensor_parallel
from lightning_nnscaler.plans.propagate import place


@dataclass(frozen=True, kw_only=True)
class HybridConfig:
    """The hybrid recipe's parameters; both required (their product is the world size)."""

    dp: int = field(metadata={"minimum": 1})
    """Data-parallel replicas (batch slices)."""
    tp: int = field(metadata={"minimum": 1})
    """Tensor-parallel devices per replica."""


def hybrid(graph: Graph, ctx: PlanContext, config: HybridConfig) -> None:
    """Split the batch into ``dp`` replicas, then each replica's ops Megatron-style into ``tp`` pieces.

    Devices form a ``dp × tp`` grid: piece ``t`` of replica ``r`` runs on device ``r * tp + t``, so
    each tensor-parallel group is ``tp`` consecutive ranks (the fast links inside a node).
    """
    dp, tp = config.dp, config.tp
    if dp < 1 or tp < 1 or dp * tp != ctx.world_size:
        raise ValueError(f"hybrid: dp ({dp}) × tp ({tp}) = {dp * tp} must equal world_size ({ctx.world_size})")
    choose = megatron_choice(graph)  # on the whole graph, before the batch split renames its ops
    replicas = split_batch(graph, dp)  # every op as dp pieces
    for replica in range(dp):
        region = [pieces[replica].name for pieces in replicas]
        place(graph, tensor_parallel(graph, tp, region, choose, share_kv_heads=True), range(replica * tp, (replica + 1) * tp))


def hybrid_layout(world_size: int, params: dict[str, Any]) -> RecipeLayout:
    """``dp`` replicas of ``tp`` consecutive ranks; heads cut in ``tp``."""
    dp, tp = params["dp"], params["tp"]
    if dp < 1 or tp < 1 or dp * tp != world_size:
        raise ValueError(f"hybrid: dp ({dp}) × tp ({tp}) = {dp * tp} must equal world_size ({world_size})")
    return RecipeLayout(DeviceGrid.of(dp=dp, tp=tp), tp, f"tp={tp}")
