"""ZeRO: data parallelism with optimizer state (stage 1), or parameters too (stage 3), sharded over the devices."""

from __future__ import annotations

from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.plans.context import PlanContext
from lightning_nnscaler.plans.dp import dp


def zero1(graph: Graph, ctx: PlanContext) -> None:
    """`dp`, with each device keeping 1/world_size of the optimizer state (the runtime does the sharding)."""
    dp(graph, ctx)
    ctx.zero_stage = 1


def zero3(graph: Graph, ctx: PlanContext) -> None:
    """`dp`, with parameters sharded too: the runtime gathers each one before use and frees it after."""
    dp(graph, ctx)
    ctx.zero_stage = 3
