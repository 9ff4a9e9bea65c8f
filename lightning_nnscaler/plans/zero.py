"""ZeRO: data parallelism with optimizer state (stage 1), or parameters too (stage 3), sharded over the devices."""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.plans.context import PlanContext
from lightning_nnscaler.plans.dp import dp
from lightning_nnscaler.plans.pipeline import PipelineSettings, pipeline


@dataclass(frozen=True, kw_only=True)
class Zero3Config:
    """The zero3 recipe's parameters."""

    stages: int = field(default=1, metadata={"minimum": 1})
    """Parts the model is cut into, in layer order (as pipeline stages, all on every rank): each rank gathers one
    part's parameters just before its forward and again before its backward, and frees them after; its gradients
    are reduce-scattered right after its backward. 1 gathers every parameter for the whole step."""


def zero1(graph: Graph, ctx: PlanContext) -> None:
    """`dp`, with each device keeping 1/world_size of the optimizer state (the runtime does the sharding)."""
    dp(graph, ctx)
    ctx.zero_stage = 1


def zero3(graph: Graph, ctx: PlanContext, config: Zero3Config) -> None:
    """`dp`, with parameters sharded too: the program gathers them before use and frees them after (per stage)."""
    if config.stages == 1:
        dp(graph, ctx)
    else:  # every rank runs stage 0..n-1's forwards, then their backwards: the program's GATHER/FREE go around each
        pipeline(graph, ctx, "interleaved", PipelineSettings(stages=1, virtual_stages=config.stages, microbatches=1))
    ctx.zero_stage = 3
