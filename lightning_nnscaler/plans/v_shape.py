"""The V-shaped pipelines as catalog recipes: ZB-V and V-Half (Qi et al. 2024, "Pipeline Parallelism with
Controllable Memory"), and DualPipeV (DeepSeek-V3's DualPipe on one model copy, ``schedules.dual_pipe``).
Rank ``r`` of ``p`` holds stages ``r`` and ``2p - 1 - r`` (``schedules.v_shape``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.plans.context import PlanContext
from lightning_nnscaler.plans.parameters import fields_of
from lightning_nnscaler.plans.pipeline import PipelineSettings, pipeline
from lightning_nnscaler.plans.pipeline_recipes import COUNT, STAGE_INDEX


@dataclass(frozen=True, kw_only=True)
class VShapeConfig:
    """zbv, vhalf and dualpipev: two model stages per rank."""

    stages: int | None = field(default=None, metadata=COUNT)
    """Pipeline ranks per data-parallel replica (each holds two model stages); null means world_size (one replica)."""
    microbatches: int | None = field(default=None, metadata=COUNT)
    """Microbatches per replica and step; null means the smallest divisor of the replica's batch that is at least
    what the schedule needs (stages; 2 x stages for dualpipev, one per model stage)."""
    balance: str = "estimate"
    """What the stage cut balances: estimate (each op's work from its shapes: FLOPs of matmuls, elements otherwise) or
    measured (each op's forward and backward timed on the run's device before planning, rank 0's times used by every
    rank; cached per device); not with layers_per_stage."""
    layers_per_stage: tuple[int, ...] | None = field(default=None, metadata=STAGE_INDEX)
    """Layer counts, one per model stage (2 per rank, in stage order 0 .. 2p-1), e.g. 2,2,2,2; a layer is a
    numbered module (blocks.3); embeddings join the first stage, heads the last; null cuts by cost."""


@dataclass(frozen=True, kw_only=True)
class ZeroBubbleVConfig(VShapeConfig):
    """zbv and vhalf: a V ordered within a memory limit."""

    activation_limit: str = "stages"
    """What the limit counts (ZB-V: 1F1B's activation peak; V-Half: half of it): stages (the paper's: each stage's
    activations count alike) or bytes (each stage's saved-for-backward bytes, estimated from the graph: the limit
    holds where a stage keeps more than another, such as the head's, at the cost of bubble)."""


def zbv_plan(graph: Graph, ctx: PlanContext, config: ZeroBubbleVConfig) -> None:
    """ZB-V: zero bubble at 1F1B's activation memory; backward split into input (I) and weight (W) gradients."""
    pipeline(graph, ctx, "zbv", PipelineSettings(**fields_of(config)))


def vhalf_plan(graph: Graph, ctx: PlanContext, config: ZeroBubbleVConfig) -> None:
    """V-Half: about half of 1F1B's activation memory, for a small bubble."""
    pipeline(graph, ctx, "vhalf", PipelineSettings(**fields_of(config)))


def dualpipev_plan(graph: Graph, ctx: PlanContext, config: VShapeConfig) -> None:
    """DualPipeV: DeepSeek-V3's overlapped forward/backward pairs in the V; needs at least 2 microbatches per rank."""
    pipeline(graph, ctx, "dualpipev", PipelineSettings(**fields_of(config)))
