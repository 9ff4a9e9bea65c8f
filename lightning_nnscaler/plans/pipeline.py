"""Pipeline parallelism from the three primitives (DESIGN.md §8): GPipe, 1F1B, interleaved 1F1B, ZB-H1, dp × tp × pp.

- **Microbatches are op_trans** of the batch dim: ``split_batch`` cuts every op into
  ``replicas × microbatches`` pieces (batch slices where the batch reaches, copies elsewhere).
- **Stages are op_assign** of contiguous op ranges: the graph's ops are cut into stages of about
  equal estimated cost, or by layers per stage (``plans.stage_cuts``); the prologue (ops that need no
  gradient and read only the batch and constants) runs on the rank of its first reader.
- **The schedule is op_order**: a ``schedules`` generator orders each rank's segments; it is
  validated (``schedules.validate``) before anything runs. What differs between schedules is data, one
  ``ScheduleRule`` each in ``SCHEDULE_RULES`` (its generator, stages per rank, microbatches per rank, whether
  microbatches run in groups, whether its stages are each one rank's own); ``pipeline`` is the one path.
- **Recompute per stage is op_recompute**: on the ranks of ``recompute_stages`` each segment is one
  recompute group (``recompute_segments``). Under 1F1B stage ``r`` of ``p`` stashes ``p - r``
  microbatches, so recomputing the first stages saves the most memory for the least time.
- **Co-shard per stage is op_trans, op_assign and op_recompute** (``plans.coshard`` inside a stage): on
  the ranks of ``coshard_stages`` each segment's Megatron splits are cut into ``shards`` pieces per rank,
  run one after another, each its own recompute group, so a stashed microbatch keeps only what enters
  the pieces and its backward holds one shard's activations at a time.

Inside a stage, ``tp > 1`` splits each segment's ops Megatron-style over the stage's tensor-parallel
ranks. Ranks form the grid ``dp × pp × tp`` (tp fastest): stage ``s`` lives on pipeline column
``schedule.stage_ranks[s]`` of every replica. The recipes that call ``pipeline`` are in ``plans.pipeline_recipes``
and ``plans.v_shape``; its checks in ``plans.pipeline_checks``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir.op import PROLOGUE, Op
from lightning_nnscaler.plans.context import PlanContext, PipelinePlan
from lightning_nnscaler.plans.dp import split_batch
from lightning_nnscaler.plans.interlaced import SharedLayers, find_shared_layers, gather_lookups, vocabulary_choice, vocabulary_parallel_losses
from lightning_nnscaler.plans.layout import DeviceGrid
from lightning_nnscaler.plans.megatron_tp import megatron_choice, tensor_parallel
from lightning_nnscaler.plans.pipeline_checks import (
    check_microbatches, check_microbatches_split, check_stage_indices, count_recycles, default_microbatches, imported_schedule,
    refuse_sync_batch_norm,
)
from lightning_nnscaler.plans.propagate import propagate, replicate
from lightning_nnscaler.plans.recompute import op_recompute
from lightning_nnscaler.plans.stage_cuts import PROLOGUE_STAGE, OpPrices, StageCut, cut_stages, op_kinds
from lightning_nnscaler.plans.stage_memory import stage_saved_bytes
from lightning_nnscaler.primitives import TransformError, op_assign, op_orders, op_trans
from lightning_nnscaler.schedules import Action, Kind, Schedule, gpipe, interlaced, interleaved, lower, one_f_one_b, three_f_one_b, validate, zb1
from lightning_nnscaler.schedules.dual_pipe import dual_pipe_v
from lightning_nnscaler.schedules.metrics import SPLIT_SHARE, WEIGHT_SHARE
from lightning_nnscaler.schedules.v_shape import Cost, v_half, zbv


@dataclass(frozen=True, kw_only=True)
class PipelineSettings:
    """Everything ``pipeline`` reads besides the schedule; a recipe's config fills the fields it has."""

    stages: int | None = None
    """Pipeline ranks per replica (default: ``world_size / (dp × tp)``)."""
    microbatches: int | None = None
    """Per replica and step (default: the smallest divisor of the replica's batch that is at least
    ``stages`` times the schedule's microbatches per rank)."""
    virtual_stages: int = 1
    """Model chunks per rank (interleaved only)."""
    dp: int | None = None
    """Data-parallel replicas (default: ``world_size / (stages × tp)``)."""
    tp: int = 1
    """Tensor-parallel ranks per stage."""
    shared_layers: Sequence[str] | None = None
    """Interlaced only: the op names of the layers split by vocabulary over all the pipeline's ranks
    (default: found from the graph, see ``plans.interlaced``)."""
    layers_per_stage: Sequence[int] | None = None
    """How many of the model's layers each stage (each chunk) holds, instead of cuts balanced by cost
    (``stage_cuts.model_layers``)."""
    balance: str = "estimate"
    """What prices the cut: ``estimate`` (each op's work from its shapes, ``stage_cuts.op_cost``) or ``measured``
    (each op's forward and backward timed on the run's device, ``PlanContext.measured_prices``)."""
    recompute_stages: Sequence[int] | None = None
    """Pipeline ranks whose activations are recomputed in backward (``recompute_segments``); for
    interleaved, every chunk of each named rank."""
    coshard_stages: Sequence[int] | None = None
    """Pipeline ranks whose segments are co-sharded: Megatron splits cut into ``shards`` pieces per rank
    (times ``tp``), run one after another, each recomputed alone (``plans.coshard``)."""
    shards: int = 2
    """Pieces per rank of each split on the ``coshard_stages`` (at least 2)."""
    activation_limit: str = "stages"
    """What the V schedules' memory limit counts (``ACTIVATION_LIMITS``): stages alike (the paper's) or each
    stage's saved bytes (``stage_saved_bytes``)."""
    schedule_csv: str | None = None
    """A per-rank action table in torch.distributed.pipelining's CSV format run instead of the schedule's
    generator (``pipeline_checks.imported_schedule``); it fixes the microbatches and the stages per rank."""


@dataclass(frozen=True)
class ScheduleRule:
    """How the common path treats one schedule."""

    generator: Callable[[int, int, int], Schedule]
    """``generator(ranks, microbatches, stages_per_rank)``: each rank's compute-only order."""
    stages_per_rank: int | Callable[[Graph, PipelineSettings], int] = 1
    """Model stages per pipeline rank, or how to count them (interleaved: ``virtual_stages``; 3f1b: the recycling passes)."""
    microbatches_per_rank: int = 1
    """The least microbatches per pipeline rank the default count gives (DualPipeV pairs two)."""
    grouped: bool = False
    """Whether microbatches run in groups of one per pipeline rank when a rank holds several stages
    (then their count is a multiple of the ranks)."""
    own_stages: bool = True
    """Whether every stage is one rank's own, so the per-stage options apply (not 3f1b's forward-only
    stages, nor interlaced's shared ones)."""
    shared_vocabulary: bool = False
    """Whether the vocabulary layers are shared stages run by every rank (interlaced, ``plans.interlaced``)."""
    timed: Callable[[int, int, Cost, Sequence[float] | None], Schedule] | None = None
    """``timed(ranks, microbatches, cost, saved)``: the order made in the cut stages' time (``stage_cost``), within
    its activation limit counted in the bytes each stage saves (``stage_saved_bytes``) or, with None, in stages,
    where the generator can use them (the V schedules)."""


SCHEDULE_RULES: dict[str, ScheduleRule] = {
    "gpipe": ScheduleRule(lambda ranks, microbatches, _: gpipe(ranks, microbatches)),
    "1f1b": ScheduleRule(lambda ranks, microbatches, _: one_f_one_b(ranks, microbatches)),
    "interleaved": ScheduleRule(
        lambda ranks, microbatches, chunks: interleaved(ranks, chunks, microbatches),
        stages_per_rank=lambda graph, settings: settings.virtual_stages, grouped=True,
    ),
    "zb1": ScheduleRule(lambda ranks, microbatches, _: zb1(ranks, microbatches)),
    "3f1b": ScheduleRule(three_f_one_b, stages_per_rank=lambda graph, settings: count_recycles(graph), own_stages=False),
    "interlaced": ScheduleRule(lambda ranks, microbatches, _: interlaced(ranks, microbatches), own_stages=False, shared_vocabulary=True),
    # the V (schedules.v_shape): rank r holds stages r and 2p - 1 - r, placed by the order's stage_ranks
    "zbv": ScheduleRule(lambda ranks, microbatches, _: zbv(ranks, microbatches), stages_per_rank=2, timed=zbv),
    "vhalf": ScheduleRule(lambda ranks, microbatches, _: v_half(ranks, microbatches), stages_per_rank=2, timed=v_half),
    "dualpipev": ScheduleRule(lambda ranks, microbatches, _: dual_pipe_v(ranks, microbatches), stages_per_rank=2, microbatches_per_rank=2),
}
SCHEDULES = tuple(SCHEDULE_RULES)
BALANCES = ("estimate", "measured")
"""What a stage cut may be priced by (``PipelineSettings.balance``)."""
ACTIVATION_LIMITS = ("stages", "bytes")
"""What the V schedules' memory limit may count (``PipelineSettings.activation_limit``)."""


@dataclass(frozen=True)
class Placement:
    """What the common path decided before placing ops: the grid, the order, the stage of each op."""

    grid: DeviceGrid
    """``dp × pp × tp`` ranks."""
    order: Schedule
    """The validated order over the ``pp`` pipeline ranks."""
    cut: StageCut
    """Each op's stage."""
    shared: SharedLayers | None
    """The layers every pipeline rank runs together (interlaced), else None."""

    @property
    def pp(self) -> int:
        """Pipeline ranks per replica."""
        return self.grid.axis_size("pp")

    def ranks(self, replica: int, column: int) -> list[int]:
        """The tensor-parallel ranks of pipeline ``column`` in ``replica``."""
        tp = self.grid.axis_size("tp")
        first = (replica * self.pp + column) * tp
        return list(range(first, first + tp))


def pipeline(graph: Graph, ctx: PlanContext, schedule: str, settings: PipelineSettings | None = None) -> None:
    """Plan ``graph`` as a pipeline (see the module docstring) with ``schedule`` (one of ``SCHEDULES``); sets ``ctx.pipeline``.

    Raises:
        ValueError: naming the setting and the fix, before the graph is touched.
    """
    settings = settings or PipelineSettings()
    if schedule not in SCHEDULE_RULES:
        raise ValueError(f"pipeline: schedule must be one of {SCHEDULES}, got {schedule!r}")
    rule = SCHEDULE_RULES[schedule]
    if settings.microbatches != 1:  # one microbatch: each stage's forward sees the whole batch (zero3's stages)
        refuse_sync_batch_norm(graph, schedule)
    _check_settings(schedule, rule, settings)
    chunks = rule.stages_per_rank(graph, settings) if callable(rule.stages_per_rank) else rule.stages_per_rank
    grid = _grid(ctx.world_size, settings)
    order, chunks = _order(graph, schedule, rule, settings, grid, chunks)
    placement = _timed(graph, rule, settings, Placement(grid, order, *_cut(graph, order, chunks, rule, settings, _prices(schedule, settings, ctx))))
    order = placement.order
    coshard = {column: settings.shards for column in settings.coshard_stages or ()}
    choose = megatron_choice(graph) if settings.tp > 1 or coshard else None
    _place(graph, placement)
    if settings.tp > 1 or coshard:
        _split_stages(graph, settings.tp, grid, order, choose, coshard)
    if settings.recompute_stages:
        recompute_segments(graph, order, settings.recompute_stages)
    ctx.pipeline = PipelinePlan(
        order, tuple(grid.coordinate(rank, "pp") for rank in range(ctx.world_size)), _shares(placement.cut),
        settings.balance if settings.layers_per_stage is None else "estimate",
    )
    order_forwards(graph, ctx.pipeline)


def _check_settings(schedule: str, rule: ScheduleRule, settings: PipelineSettings) -> None:
    """Refuse options a schedule cannot take (per-stage ones where stages are not one rank's own, virtual stages,
    tensor parallelism around shared layers), co-shard without enough shards and layer counts of all 0."""
    named = {"recompute_stages": settings.recompute_stages, "coshard_stages": settings.coshard_stages}
    for key, stages in named.items():
        if stages and not rule.own_stages:
            raise ValueError(
                f"{schedule}: {key} is not supported (its forward-only or shared stages are not one rank's own); "
                "use it with gpipe, 1f1b, zb1, interleaved or hybrid3d"
            )
    shards = settings.shards
    if settings.coshard_stages and (not isinstance(shards, int) or isinstance(shards, bool) or shards < 2):
        raise ValueError(f"pipeline: shards must be an int >= 2 for coshard_stages {list(settings.coshard_stages)}, got {shards!r}")
    if not callable(rule.stages_per_rank) and settings.virtual_stages != 1:
        raise ValueError(f"pipeline: virtual_stages={settings.virtual_stages} needs schedule='interleaved'")
    if settings.layers_per_stage is not None and not rule.own_stages:
        raise ValueError(f"{schedule}: layers_per_stage is not supported (its stages are cut by cost)")
    if settings.layers_per_stage is not None and not any(settings.layers_per_stage):
        raise ValueError(f"layers_per_stage counts must be >= 0 and not all 0, got {list(settings.layers_per_stage)}")
    if settings.tp != 1 and rule.shared_vocabulary:
        raise ValueError(f"{schedule}: tp={settings.tp} is not supported (its shared layers are already split over every pipeline rank)")
    if settings.activation_limit not in ACTIVATION_LIMITS:
        raise ValueError(f"{schedule}: activation_limit must be one of {ACTIVATION_LIMITS}, got {settings.activation_limit!r}")
    if settings.activation_limit != "stages" and rule.timed is None:
        raise ValueError(f"{schedule}: activation_limit={settings.activation_limit!r} is for zbv and vhalf, whose order keeps a memory limit")
    if settings.activation_limit != "stages" and settings.schedule_csv is not None:
        raise ValueError(f"{schedule}: activation_limit={settings.activation_limit!r} orders the generator's actions; schedule_csv fixes the order: give one of them")
    if settings.schedule_csv is not None and not rule.own_stages:
        raise ValueError(f"{schedule}: schedule_csv is not supported (its forward-only or shared stages are placed by the recipe)")


def _grid(world_size: int, settings: PipelineSettings) -> DeviceGrid:
    """``dp × pp × tp`` over ``world_size`` ranks, with the per-stage options checked against ``pp``."""
    tp = settings.tp
    pp = settings.stages if settings.stages is not None else world_size // ((settings.dp or 1) * tp)  # 0 is refused, never "all"
    dp = settings.dp if settings.dp is not None else world_size // max(pp * tp, 1)
    if min(pp, dp, tp) < 1 or dp * pp * tp != world_size:
        raise ValueError(f"pipeline: dp ({dp}) × stages ({pp}) × tp ({tp}) must equal world_size ({world_size})")
    check_stage_indices(settings.recompute_stages, pp)
    check_stage_indices(settings.coshard_stages, pp, "coshard_stages")
    both = sorted(set(settings.recompute_stages or ()) & set(settings.coshard_stages or ()))
    if both:
        raise ValueError(
            f"pipeline: stage {', '.join(map(str, both))} is in both recompute_stages and coshard_stages; "
            "a co-sharded stage already recomputes, one shard at a time: name it in one of them"
        )
    return DeviceGrid.of(dp=dp, pp=pp, tp=tp)


def _order(
    graph: Graph, schedule: str, rule: ScheduleRule, settings: PipelineSettings, grid: DeviceGrid, chunks: int,
) -> tuple[Schedule, int]:
    """The validated order and its stages per rank: the imported table's, or the rule's generator's with the
    microbatches checked or chosen."""
    dp, pp = grid.axis_size("dp"), grid.axis_size("pp")
    microbatches = settings.microbatches
    imported = imported_schedule(settings.schedule_csv, pp, microbatches) if settings.schedule_csv is not None else None
    if imported is not None:
        microbatches, chunks = imported.microbatches, imported.stages // pp
    batch = _batch_rows(graph)
    if batch % dp:
        raise ValueError(f"pipeline: the batch ({batch} rows) must divide into {dp} data-parallel replicas")
    multiple_of = pp if rule.grouped and chunks > 1 and imported is None else 1
    chosen = microbatches is None
    if chosen:
        microbatches = default_microbatches(batch // dp, pp * rule.microbatches_per_rank, multiple_of=multiple_of)
    check_microbatches(schedule, batch // dp, microbatches, multiple_of, chosen=chosen)
    order = imported or rule.generator(pp, microbatches, chunks)
    validate(lower(order))
    return order, chunks


def _prices(schedule: str, settings: PipelineSettings, ctx: PlanContext) -> OpPrices | None:
    """The prices the stage cut balances: None for the estimate from shapes, the context's measured ones for ``measured``.

    Raises:
        ValueError: an unknown ``balance``, ``measured`` with ``layers_per_stage`` or without measured prices.
    """
    if settings.balance not in BALANCES:
        raise ValueError(f"{schedule}: balance must be one of {BALANCES}, got {settings.balance!r}")
    if settings.balance == "estimate":
        return None
    if settings.layers_per_stage is not None:
        raise ValueError(f"{schedule}: balance='measured' prices a cut by cost; layers_per_stage fixes the cut: give one of them")
    if ctx.measured_prices is None:
        raise ValueError(
            f"{schedule}: balance='measured' needs op times measured on the run's device: plan with lightning_nnscaler.parallelize "
            "or NnScalerStrategy (they measure them), or pass PlanContext(measured_prices=...)"
        )
    return ctx.measured_prices


def _cut(
    graph: Graph, order: Schedule, chunks: int, rule: ScheduleRule, settings: PipelineSettings, prices: OpPrices | None,
) -> tuple[StageCut, SharedLayers | None]:
    """Each op's stage (``chunks`` per rank) by ``prices``; for shared vocabulary layers (interlaced), the layers split over
    every rank, fixed to the input stage 0 and the output stage ``pp + 1`` around the ``pp`` cut ones."""
    pp = len(order.actions)
    if not rule.shared_vocabulary:
        return cut_stages(graph, pp * chunks, forward_only=order.forward_only, layers_per_stage=settings.layers_per_stage, prices=prices), None
    kinds = op_kinds(graph, list(graph.ops), {output.name: op for op in graph.ops for output in op.outputs})
    shared = vocabulary_parallel_losses(graph, gather_lookups(graph, find_shared_layers(graph, kinds, settings.shared_layers)))
    fixed = {name: 0 for name in shared.input_stage} | {name: pp + 1 for name in shared.output_stage}
    return cut_stages(graph, pp, fixed=fixed, first=1, prices=prices), shared


def _timed(graph: Graph, rule: ScheduleRule, settings: PipelineSettings, placement: Placement) -> Placement:
    """The placement with its order made again in its cut stages' time and saved bytes, where the rule's generator
    can (not for an imported table)."""
    if rule.timed is None or settings.schedule_csv is not None or not placement.cut.work:
        return placement
    saved = stage_saved_bytes(graph, placement.cut, len(placement.order.stage_ranks)) if settings.activation_limit == "bytes" else None
    order = rule.timed(placement.pp, placement.order.microbatches, stage_cost(_shares(placement.cut)), saved)
    validate(lower(order))
    return dataclasses.replace(placement, order=order)


def _shares(cut: StageCut) -> tuple[tuple[int, float], ...]:
    """Each cut stage's share of the work it was cut by (``PipelinePlan.stage_work``)."""
    total = sum(work for _, work in cut.work) or 1.0
    return tuple((stage, work / total) for stage, work in cut.work)


def stage_cost(work: Sequence[tuple[int, float]]) -> Cost:
    """Each compute action's duration from its stage's share of the cut's work: F a third, the whole backward two thirds,
    split as the simulator prices a split backward (B ``SPLIT_SHARE`` of it, W ``WEIGHT_SHARE``), except on stage 0,
    whose inputs come from the batch and need no gradient: its B is empty and its W the whole backward."""
    shares = dict(work)

    def cost(action: Action) -> float:
        forward = shares.get(action.stage, 0.0) / 3
        if action.kind is Kind.FORWARD:
            return forward
        if action.stage == 0:
            return 2 * forward if action.kind is Kind.WEIGHT else 0.0
        return 2 * forward * (WEIGHT_SHARE if action.kind is Kind.WEIGHT else SPLIT_SHARE)

    return cost


def _place(graph: Graph, placement: Placement) -> None:
    """op_trans of the batch into replicas × microbatches, op_assign of each piece to its stage's first
    tensor-parallel rank (split over the others later); shared stages over every pipeline rank."""
    order, cut, shared, pp = placement.order, placement.cut, placement.shared, placement.pp
    microbatches = order.microbatches
    origins = [op.name for op in graph.ops]
    pieces = split_batch(graph, placement.grid.axis_size("dp") * microbatches)
    check_microbatches_split(pieces)
    vocabulary_split: dict[tuple[int, int], list[str]] = {}  # (replica, microbatch) -> its output-stage ops to walk
    for index, name in enumerate(origins):
        stage = cut.stage_of[name]
        placing = stage if stage != PROLOGUE_STAGE else cut.first_reader_stage(name)
        for part, piece in enumerate(pieces[index]):
            replica, microbatch = divmod(part, microbatches)
            segment = PROLOGUE if stage == PROLOGUE_STAGE else (stage, microbatch)
            if not order.is_shared(placing):
                placed = op_assign(graph, piece, placement.ranks(replica, order.stage_ranks[placing])[0], segment=segment)
                if 0 <= stage < order.forward_only and not placed.no_grad:  # a recycling stage: no gradient flows through it
                    graph.replace_op(placed, [placed.evolve(no_grad=True)])
            elif stage == pp + 1 and name not in shared.hand_ins:
                vocabulary_split.setdefault((replica, microbatch), []).append(piece.name)
            else:
                place_shared(graph, piece, shared, [placement.ranks(replica, column)[0] for column in range(pp)], segment)
    for (replica, microbatch), names in vocabulary_split.items():
        _split_vocabulary(graph, names, shared, [placement.ranks(replica, column)[0] for column in range(pp)], (pp + 1, microbatch))


def _split_vocabulary(graph: Graph, names: list[str], shared: SharedLayers, ranks: list[int], segment: tuple[int, int]) -> None:
    """The output stage's ops of one (replica, microbatch), split by a walk from the vocabulary projections over ``ranks``."""
    walk = propagate(graph, len(ranks), ops=names, choose=vocabulary_choice(shared))
    for split in walk.split:
        for piece, rank in zip(split, ranks):
            op_assign(graph, piece, rank, segment=segment)
    for whole in walk.whole:
        for copy, rank in zip(replicate(graph, whole, len(ranks)), ranks):
            op_assign(graph, copy, rank, segment=segment)


def recompute_segments(graph: Graph, order: Schedule, columns: Sequence[int]) -> None:
    """op_recompute: on the pipeline ranks ``columns``, each segment's ops form one recompute group.

    Group ``stage × microbatches + microbatch`` is one (stage or chunk, microbatch) segment, so a
    checkpointed block never crosses a segment boundary; the prologue and no-grad ops keep theirs.
    """
    recomputed = set(columns)
    for op in list(graph.ops):
        if op.segment is None or op.segment == PROLOGUE or op.no_grad:
            continue
        stage, microbatch = op.segment
        if order.stage_ranks[stage] in recomputed:
            op_recompute(graph, op, stage * order.microbatches + microbatch)


def place_shared(graph: Graph, piece: Op, shared: SharedLayers, ranks: list[int], segment: tuple[int, int]) -> None:
    """Place a piece of a shared stage's op over the pipeline's ``ranks`` (``plans.interlaced``): lookups
    split by vocabulary rows, the hand-in on the last rank, the rest replicated. (The output stage's
    other ops are split by a walk from the projections, in ``pipeline``.)"""
    name = piece.source_name
    if name in shared.lookups:
        try:
            parts = op_trans(graph, piece, "v", len(ranks))
        except TransformError as error:
            fix = (
                f"pad the vocabulary to a multiple of {len(ranks)} (as Megatron does), or use fewer stages" if "do not divide" in str(error)
                else "an embedding with scale_grad_by_freq or sparse gradients is not split by vocabulary; name the shared layers without it"
            )
            raise ValueError(f"interlaced: cannot split {name!r} by vocabulary over {len(ranks)} ranks ({error}); {fix}") from None
    elif name in shared.hand_ins:
        op_assign(graph, piece, ranks[-1], segment=segment)
        return
    else:
        parts = replicate(graph, piece, len(ranks))
    for part, rank in zip(parts, ranks):
        op_assign(graph, part, rank, segment=segment)


def order_forwards(graph: Graph, plan: PipelinePlan) -> None:
    """op_order: on each rank, each segment's forward ops before those of the next F in its schedule (one re-sort)."""
    ops_of: dict[tuple[int, tuple[int, int]], list[Op]] = {}
    for op in graph.ops:
        if op.segment != PROLOGUE:
            ops_of.setdefault((op.device, op.segment), []).append(op)
    edges = []
    for rank in range(len(plan.column_of_rank)):
        forwards = [(action.stage, action.microbatch) for action in plan.actions(rank) if action.kind.value == "F"]
        present = [ops_of[(rank, segment)] for segment in forwards if (rank, segment) in ops_of]
        edges += [(earlier[-1], later[0]) for earlier, later in zip(present, present[1:])]
    op_orders(graph, edges)


def _batch_rows(graph: Graph) -> int:
    rows = {tensor.shape[0] for tensor in graph.user_inputs if tensor.shape}
    if len(rows) != 1:
        raise ValueError(f"pipeline: the batch inputs must share one batch size (dim 0), got {sorted(rows)}")
    return rows.pop()


# --- tensor parallelism inside stages --------------------------------------------------------------


def _split_stages(graph: Graph, tp: int, grid: DeviceGrid, order: Schedule, choose, shards: dict[int, int]) -> None:
    """Megatron-split each (replica, stage, microbatch) segment's ops over its stage's ``tp`` ranks; on a pipeline
    column in ``shards`` (column -> pieces per rank), into ``tp × shards`` pieces, ``shards`` consecutive ones per
    rank, each stretch of each piece its own recompute group (``plans.coshard``)."""
    by_segment: dict[tuple[int, tuple[int, int]], list[str]] = {}
    for op in graph.ops:
        if op.segment != PROLOGUE:
            by_segment.setdefault((op.device, op.segment), []).append(op.name)
    groups: dict[int, int] = {}  # rank -> recompute groups used so far (a group never spans segments)
    for (first_rank, segment), names in by_segment.items():
        ranks = list(range(first_rank, first_rank + tp))
        pieces_per_rank = shards.get(order.stage_ranks[segment[0]], 1)
        parts = tp * pieces_per_rank
        if parts == 1:
            continue
        walk = tensor_parallel(graph, parts, names, choose, share_kv_heads=pieces_per_rank == 1)
        for pieces in walk.split:
            for index, piece in enumerate(pieces):
                op_assign(graph, piece, ranks[index * tp // len(pieces)], segment=segment)
        for op in walk.whole:
            if tp > 1:
                for index, copy in enumerate(replicate(graph, op, tp)):
                    op_assign(graph, copy, ranks[index], segment=segment)
        if pieces_per_rank > 1:
            base = groups.get(first_rank, 0)
            runs = walk.runs()
            for stretch, run in enumerate(runs):
                for pieces in run:
                    for index, piece in enumerate(pieces):
                        op_recompute(graph, piece.name, base + stretch * parts + index)
            groups[first_rank] = base + len(runs) * parts
