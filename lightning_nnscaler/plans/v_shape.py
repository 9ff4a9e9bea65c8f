"""The V-shaped pipelines as catalog recipes: ZB-V and V-Half (Qi et al. 2024, "Pipeline Parallelism with
Controllable Memory"). Rank ``r`` of ``p`` holds stages ``r`` and ``2p - 1 - r`` (``schedules.v_shape``)."""

from __future__ import annotations

from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.plans.context import PlanContext
from lightning_nnscaler.plans.pipeline import layer_counts, pipeline


def zbv_plan(graph: Graph, ctx: PlanContext, *, stages: int | None = None, microbatches: int | None = None, layers_per_stage: str | None = None) -> None:
    """ZB-V: zero bubble at 1F1B's activation memory; backward split into input (I) and weight (W) gradients."""
    pipeline(graph, ctx, schedule="zbv", stages=stages, microbatches=microbatches, layers_per_stage=layer_counts(layers_per_stage))


def vhalf_plan(graph: Graph, ctx: PlanContext, *, stages: int | None = None, microbatches: int | None = None, layers_per_stage: str | None = None) -> None:
    """V-Half: about half of 1F1B's activation memory, for a small bubble."""
    pipeline(graph, ctx, schedule="vhalf", stages=stages, microbatches=microbatches, layers_per_stage=layer_counts(layers_per_stage))
