"""The pipelines as catalog recipes: each a config dataclass (its parameters) and a plan function that hands
them to ``plans.pipeline`` with its schedule. The V-shaped ones are in ``plans.v_shape``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.plans.context import PlanContext
from lightning_nnscaler.plans.layout import DeviceGrid, RecipeLayout
from lightning_nnscaler.plans.parameters import fields_of
from lightning_nnscaler.plans.pipeline import PipelineSettings, pipeline

COUNT = {"minimum": 1}  # a count of 0 is refused naming the key, never read as "the default"
STAGE_INDEX = {"minimum": 0}  # each entry: stage 0 is the first
ZERO_STAGES = (0, 1, 3)


@dataclass(frozen=True, kw_only=True)
class StagedConfig:
    """The parameters every pipeline recipe has."""

    stages: int | None = field(default=None, metadata=COUNT)
    """Pipeline ranks per data-parallel replica; null means world_size (one replica)."""
    microbatches: int | None = field(default=None, metadata=COUNT)
    """Microbatches per replica and step; null means the smallest divisor of the replica's batch that is at
    least stages (a multiple of stages, where a rank holds several stages and they run in groups)."""
    balance: str = "estimate"
    """What the stage cut balances: estimate (each op's work from its shapes: FLOPs of matmuls, elements otherwise) or
    measured (each op's forward and backward timed on the run's device before planning, rank 0's times used by every
    rank; cached per device); not with layers_per_stage."""


@dataclass(frozen=True, kw_only=True)
class PipelineConfig(StagedConfig):
    """gpipe, 1f1b and zb1: their stages cut by cost or by layers, each stage's own options, an imported order."""

    layers_per_stage: tuple[int, ...] | None = field(default=None, metadata=STAGE_INDEX)
    """Layer counts, one per stage (per chunk for interleaved), e.g. 3,3,2; a layer is a numbered module
    (blocks.3); embeddings join the first stage, heads the last; null cuts by cost."""
    recompute_stages: tuple[int, ...] | None = field(default=None, metadata=STAGE_INDEX)
    """Stage indices whose activations are recomputed in backward, e.g. 0 (under 1F1B stage r stashes
    stages - r microbatches, so the first stages save the most); each (stage, microbatch) segment is one
    checkpointed block (under zb1 recomputed in B and again in W); null recomputes none."""
    coshard_stages: tuple[int, ...] | None = field(default=None, metadata=STAGE_INDEX)
    """Stage indices whose segments are co-sharded, e.g. 0: each attention and MLP split into shards pieces
    per rank, run one after another and each recomputed alone, so a stashed microbatch keeps only what enters
    them and backward holds one piece's activations at a time; not a stage of recompute_stages; null co-shards none."""
    shards: int = 2
    """Pieces per rank of each split on the coshard_stages (at least 2: one piece is no co-shard)."""
    zero: int = field(default=0, metadata=STAGE_INDEX)
    """ZeRO stage over each stage's data-parallel replicas: 0 replicates, 1 shards the optimizer state over them,
    3 also the parameters (gathered before the stage's first forward, freed after its last backward); gradients
    accumulate over the microbatches and are reduce-scattered once, after the stage's last backward."""
    schedule_csv: str | None = None
    """Path of a per-rank action table in torch.distributed.pipelining's CSV format (one row per rank, e.g.
    '0F0,0F1,0B0,...'; F, B, I, W and SEND/RECV cells; empty cells idle) run instead of this recipe's order:
    it fixes the microbatches and the stages per rank, and is checked and validated (a deadlock is refused with
    the step x rank grid); null uses the recipe's own order."""


@dataclass(frozen=True, kw_only=True)
class InterleavedConfig(StagedConfig):
    """interleaved: ``virtual_stages`` chunks per rank; the per-stage options name ranks (all their chunks)."""

    virtual_stages: int = field(default=2, metadata=COUNT)
    """Model chunks per rank (2: half the bubble for twice the messages)."""
    layers_per_stage: tuple[int, ...] | None = field(default=None, metadata=STAGE_INDEX)
    """Layer counts, one per chunk (stages x virtual_stages of them, in stage order), e.g. 2,2,2,2; null cuts by cost."""
    recompute_stages: tuple[int, ...] | None = field(default=None, metadata=STAGE_INDEX)
    """Pipeline ranks (0 to stages - 1) whose activations are recomputed in backward, e.g. 0: every chunk of a
    named rank, each (chunk, microbatch) segment one checkpointed block; null recomputes none."""
    coshard_stages: tuple[int, ...] | None = field(default=None, metadata=STAGE_INDEX)
    """Pipeline ranks whose segments are co-sharded (every chunk of a named rank; see gpipe's); null co-shards none."""
    shards: int = 2
    """Pieces per rank of each split on the coshard_stages (at least 2: one piece is no co-shard)."""


@dataclass(frozen=True, kw_only=True)
class InterlacedConfig(StagedConfig):
    """interlaced: which layers are split by vocabulary over every pipeline rank."""

    shared_layers: tuple[str, ...] | None = None
    """Op names of the layers to split by vocabulary (embedding lookups and linears onto the vocabulary);
    null means found from the graph: lookups into the largest embedding table (at least 4 rows per column)
    and the linears whose outputs are that many."""


@dataclass(frozen=True, kw_only=True)
class Hybrid3DConfig:
    """hybrid3d: dp x tp x pp ranks, a 1F1B pipeline of pp stages in each replica."""

    dp: int = field(default=1, metadata=COUNT)
    """Data-parallel replicas."""
    tp: int = field(default=1, metadata=COUNT)
    """Tensor-parallel ranks per stage."""
    pp: int = field(default=2, metadata=COUNT)
    """Pipeline stages per replica (2: the least that is a pipeline)."""
    microbatches: int | None = field(default=None, metadata=COUNT)
    """Microbatches per replica and step; null means the smallest divisor of the replica's batch that is at least pp."""
    balance: str = "estimate"
    """What the stage cut balances: estimate (each op's work from its shapes: FLOPs of matmuls, elements otherwise) or
    measured (each op's forward and backward timed on the run's device before planning, rank 0's times used by every
    rank; cached per device); not with layers_per_stage."""
    recompute_stages: tuple[int, ...] | None = field(default=None, metadata=STAGE_INDEX)
    """Stage indices (0 to pp - 1) whose activations are recomputed in backward, e.g. 0 (stage r stashes
    pp - r microbatches); each (stage, microbatch) segment is one checkpointed block on each of the stage's
    tp ranks; null recomputes none."""
    coshard_stages: tuple[int, ...] | None = field(default=None, metadata=STAGE_INDEX)
    """Stage indices whose segments are co-sharded (see gpipe's); not a stage of recompute_stages; null co-shards none."""
    shards: int = 2
    """Pieces per rank of each split on the coshard_stages (at least 2: one piece is no co-shard)."""
    zero: int = field(default=0, metadata=STAGE_INDEX)
    """ZeRO stage over the dp replicas of each stage (with tp, over dp x tp ranks for the boxes a stage's tp ranks
    replicate): 0 replicates, 1 shards the optimizer state, 3 also the parameters (gathered before the stage's first
    forward, freed after its last backward); gradients accumulate over the microbatches and are reduce-scattered
    once, after the stage's last backward."""


def _settings(ctx: PlanContext, recipe: str, config: PipelineConfig | Hybrid3DConfig) -> dict[str, Any]:
    """The config's fields for ``PipelineSettings``, its ``zero`` taken off and set on ``ctx``.

    Raises:
        ValueError: ``zero`` is not 0, 1 or 3.
    """
    fields = fields_of(config)
    zero = fields.pop("zero")
    if zero not in ZERO_STAGES:
        raise ValueError(f"{recipe}: zero must be 0, 1 or 3 (a ZeRO stage; 2 is not one), got {zero!r}")
    ctx.zero_stage = zero
    return fields


def gpipe_plan(graph: Graph, ctx: PlanContext, config: PipelineConfig) -> None:
    """GPipe (Huang et al. 2019): all forwards, then all backwards; ``stages`` ranks (default: all)."""
    pipeline(graph, ctx, "gpipe", PipelineSettings(**_settings(ctx, "gpipe", config)))


def one_f_one_b_plan(graph: Graph, ctx: PlanContext, config: PipelineConfig) -> None:
    """1F1B (PipeDream-Flush): warm-up forwards, then one forward one backward; at most p microbatches stashed
    (``p - r`` on stage ``r``, so recomputing the first stages saves the most)."""
    pipeline(graph, ctx, "1f1b", PipelineSettings(**_settings(ctx, "1f1b", config)))


def zb1_plan(graph: Graph, ctx: PlanContext, config: PipelineConfig) -> None:
    """Zero-bubble ZB-H1 (Qi et al. 2024): backward split into input gradients (B) and weight gradients (W).
    A recomputed stage runs its forward again in B and again in W (each backward pass recomputes)."""
    pipeline(graph, ctx, "zb1", PipelineSettings(**_settings(ctx, "zb1", config)))


def interleaved_plan(graph: Graph, ctx: PlanContext, config: InterleavedConfig) -> None:
    """Interleaved 1F1B (Megatron): ``virtual_stages`` model chunks per rank; the bubble shrinks by that factor.
    ``recompute_stages`` names pipeline ranks (columns): every chunk of a named rank is recomputed."""
    pipeline(graph, ctx, "interleaved", PipelineSettings(**fields_of(config)))


def three_f_one_b_plan(graph: Graph, ctx: PlanContext, config: StagedConfig) -> None:
    """3F1B for models with recycling: each no-grad recycling pass is cut into ``stages`` forward-only
    stages, placed like the gradient pass's; each rank runs them over every microbatch, then 1F1B on its
    gradient-pass stage (``schedules.three_f_one_b``)."""
    pipeline(graph, ctx, "3f1b", PipelineSettings(**fields_of(config)))


def interlaced_plan(graph: Graph, ctx: PlanContext, config: InterlacedConfig) -> None:
    """Interlaced pipeline for large vocabularies: embedding lookups and the vocabulary projection split
    over all ``stages`` ranks, run by every rank between its 1F1B actions (``plans.interlaced``)."""
    pipeline(graph, ctx, "interlaced", PipelineSettings(**fields_of(config)))


def hybrid3d(graph: Graph, ctx: PlanContext, config: Hybrid3DConfig) -> None:
    """dp × tp × pp: ``dp`` replicas, each a 1F1B pipeline of ``pp`` stages, each stage Megatron-split over ``tp`` ranks;
    ``zero`` shards each stage's optimizer state (1) or parameters too (3) over its replicas."""
    fields = _settings(ctx, "hybrid3d", config)
    pipeline(graph, ctx, "1f1b", PipelineSettings(stages=fields.pop("pp"), **fields))


def pipeline_layout(world_size: int, params: dict[str, Any]) -> RecipeLayout:
    """``world_size / stages`` data-parallel replicas of a ``stages``-rank pipeline."""
    stages = world_size if params.get("stages") is None else params["stages"]  # 0 is refused, never read as "all"
    if stages < 1 or world_size % stages:
        raise ValueError(f"pipeline: stages ({stages}) must be a positive divisor of world_size ({world_size})")
    return RecipeLayout(DeviceGrid.of(dp=world_size // stages, pp=stages))


def hybrid3d_layout(world_size: int, params: dict[str, Any]) -> RecipeLayout:
    """``dp`` replicas of ``pp`` stages of ``tp`` consecutive ranks; heads cut in ``tp``."""
    dp, tp, pp = params["dp"], params["tp"], params["pp"]
    if min(dp, tp, pp) < 1 or dp * tp * pp != world_size:
        raise ValueError(f"hybrid3d: dp ({dp}) × tp ({tp}) × pp ({pp}) = {dp * tp * pp} must equal world_size ({world_size})")
    return RecipeLayout(DeviceGrid.of(dp=dp, pp=pp, tp=tp), tp if tp > 1 else None, f"tp={tp}")
