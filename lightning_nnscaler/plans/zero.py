"""ZeRO: data parallelism with optimizer state (stage 1), or parameters too (stage 3), sharded over the devices."""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.plans.context import PlanContext
from lightning_nnscaler.plans.dp import dp
from lightning_nnscaler.plans.pipeline import PipelineSettings, pipeline
from lightning_nnscaler.plans.stage_cuts import model_layers


@dataclass(frozen=True, kw_only=True)
class Zero3Config:
    """The zero3 recipe's parameters."""

    stages: int | None = field(default=None, metadata={"minimum": 1})
    """Parts the model is cut into, in layer order (as pipeline stages, all on every rank): each rank gathers one
    part's parameters just before its forward and again before its backward, and frees them after; its gradients
    are reduce-scattered right after its backward. Default: one part per layer (numbered modules such as
    ``blocks.3``; the embeddings join the first, the head the last), or 1 for a model without two such layers.
    A number cuts that many parts of about equal cost; 1 gathers every parameter for the whole step."""


def zero1(graph: Graph, ctx: PlanContext) -> None:
    """`dp`, with each device keeping 1/world_size of the optimizer state (the runtime does the sharding)."""
    dp(graph, ctx)
    ctx.zero_stage = 1


def zero3(graph: Graph, ctx: PlanContext, config: Zero3Config) -> None:
    """`dp`, with parameters sharded too: the program gathers them before use and frees them after (per stage)."""
    layers = model_layers(graph, list(graph.ops))[1] if config.stages is None else 0
    stages = config.stages or (layers if layers >= 2 else 1)
    if stages == 1:
        dp(graph, ctx)
    else:  # every rank runs stage 0..n-1's forwards, then their backwards: the program's GATHER/FREE go around each
        per_layer = [1] * layers if config.stages is None else None
        pipeline(graph, ctx, "interleaved", PipelineSettings(stages=1, virtual_stages=stages, microbatches=1, layers_per_stage=per_layer))
    ctx.zero_stage = 3
