"""Pipeline parallelism from the three primitives (DESIGN.md §8): GPipe, 1F1B, interleaved 1F1B, ZB-H1, dp × tp × pp.

- **Microbatches are op_trans** of the batch dim: ``split_batch`` cuts every op into
  ``replicas × microbatches`` pieces (batch slices where the batch reaches, copies elsewhere).
- **Stages are op_assign** of contiguous op ranges: the graph's ops are cut into stages of about
  equal estimated cost (FLOPs of linears, matmuls and attention; elements moved elsewhere), each cut
  placed where the fewest activation bytes cross it (between blocks: the residual stream). Ops that
  read no activation (a weight's transpose, position embeddings) join the stage of their first
  reader; ops that need no gradient and read only the batch and constants (a loss's count of kept
  targets, masks) form the step's prologue, on the rank of their first reader (one that no stage reads,
  a logged value's, with the prologue op that feeds it).
- **The schedule is op_order**: a ``schedules`` generator orders each rank's segments; it is
  validated (``schedules.validate``) before anything runs.
- **Recompute per stage is op_recompute**: on the ranks of ``recompute_stages`` each segment is one
  recompute group (``recompute_segments``). Under 1F1B stage ``r`` of ``p`` stashes ``p - r``
  microbatches, so recomputing the first stages saves the most memory for the least time.
- **Co-shard per stage is op_trans, op_assign and op_recompute** (``plans.coshard`` inside a stage): on
  the ranks of ``coshard_stages`` each segment's Megatron splits are cut into ``shards`` pieces per rank,
  run one after another, each its own recompute group, so a stashed microbatch keeps only what enters
  the pieces and its backward holds one shard's activations at a time.

Inside a stage, ``tp > 1`` splits each segment's ops Megatron-style over the stage's tensor-parallel
ranks. Ranks form the grid ``dp × pp × tp`` (tp fastest): stage ``s`` lives on pipeline column
``schedule.stage_ranks[s]`` of every replica.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir.rules.batch_norm import SYNC_MOMENTS
from lightning_nnscaler.ir.op import PROLOGUE, Op
from lightning_nnscaler.ir.tensor import dtype_bytes
from lightning_nnscaler.ir.work import op_work
from lightning_nnscaler.plans.context import PlanContext, PipelinePlan
from lightning_nnscaler.plans.dp import split_batch
from lightning_nnscaler.plans.layout import DeviceGrid, RecipeLayout
from lightning_nnscaler.plans.megatron_tp import megatron_choice, tensor_parallel
from lightning_nnscaler.plans.propagate import propagate, replicate
from lightning_nnscaler.plans.recompute import op_recompute
from lightning_nnscaler.primitives import TransformError, op_assign, op_orders, op_trans
from lightning_nnscaler.plans.interlaced import SharedLayers, find_shared_layers, gather_lookups, vocabulary_choice, vocabulary_parallel_losses
from lightning_nnscaler.schedules import Schedule, gpipe, interlaced, interleaved, lower, one_f_one_b, three_f_one_b, validate, zb1
from lightning_nnscaler.schedules.csv_import import parse_table, read_csv
from lightning_nnscaler.schedules.v_shape import v_half, zbv

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb1", "3f1b", "interlaced", "zbv", "vhalf")
V_SCHEDULES = {"zbv": zbv, "vhalf": v_half}  # 2 stages per rank, rank r holds r and 2p - 1 - r (schedules.v_shape)


PROLOGUE_STAGE = PROLOGUE[0]


def gpipe_plan(
    graph: Graph, ctx: PlanContext, *, stages: int | None = None, microbatches: int | None = None, layers_per_stage: str | None = None,
    recompute_stages: str | None = None, coshard_stages: str | None = None, shards: int = 2,
    schedule_csv: str | None = None,
) -> None:
    """GPipe (Huang et al. 2019): all forwards, then all backwards; ``stages`` ranks (default: all)."""
    pipeline(
        graph, ctx, schedule="gpipe", stages=stages, microbatches=microbatches, layers_per_stage=layer_counts(layers_per_stage),
        recompute_stages=stage_indices(recompute_stages), **_coshard(coshard_stages, shards),
        schedule_csv=schedule_csv,
    )


def one_f_one_b_plan(
    graph: Graph, ctx: PlanContext, *, stages: int | None = None, microbatches: int | None = None, layers_per_stage: str | None = None,
    recompute_stages: str | None = None, coshard_stages: str | None = None, shards: int = 2,
    schedule_csv: str | None = None,
) -> None:
    """1F1B (PipeDream-Flush): warm-up forwards, then one forward one backward; at most p microbatches stashed
    (``p - r`` on stage ``r``, so recomputing the first stages saves the most)."""
    pipeline(
        graph, ctx, schedule="1f1b", stages=stages, microbatches=microbatches, layers_per_stage=layer_counts(layers_per_stage),
        recompute_stages=stage_indices(recompute_stages), **_coshard(coshard_stages, shards),
        schedule_csv=schedule_csv,
    )


def interleaved_plan(
    graph: Graph, ctx: PlanContext, *, stages: int | None = None, microbatches: int | None = None, virtual_stages: int = 2,
    layers_per_stage: str | None = None, recompute_stages: str | None = None, coshard_stages: str | None = None, shards: int = 2,
) -> None:
    """Interleaved 1F1B (Megatron): ``virtual_stages`` model chunks per rank; the bubble shrinks by that factor.
    ``recompute_stages`` names pipeline ranks (columns): every chunk of a named rank is recomputed."""
    pipeline(
        graph, ctx, schedule="interleaved", stages=stages, microbatches=microbatches, virtual_stages=virtual_stages,
        layers_per_stage=layer_counts(layers_per_stage), recompute_stages=stage_indices(recompute_stages), **_coshard(coshard_stages, shards),
    )


def zb1_plan(
    graph: Graph, ctx: PlanContext, *, stages: int | None = None, microbatches: int | None = None, layers_per_stage: str | None = None,
    recompute_stages: str | None = None, coshard_stages: str | None = None, shards: int = 2,
    schedule_csv: str | None = None,
) -> None:
    """Zero-bubble ZB-H1 (Qi et al. 2024): backward split into input gradients (B) and weight gradients (W).
    A recomputed stage runs its forward again in B and again in W (each backward pass recomputes)."""
    pipeline(
        graph, ctx, schedule="zb1", stages=stages, microbatches=microbatches, layers_per_stage=layer_counts(layers_per_stage),
        recompute_stages=stage_indices(recompute_stages), **_coshard(coshard_stages, shards),
        schedule_csv=schedule_csv,
    )


def comma_integers(text: str | int | None, key: str, what: str, example: str) -> list[int] | None:
    """``"3,3,2"`` -> ``[3, 3, 2]`` (None stays None): a recipe parameter ``key`` given as comma-separated ``what``.

    Raises:
        ValueError: naming ``key`` and an ``example`` when an entry is not an integer.
    """
    if text is None:
        return None
    try:
        return [int(part) for part in str(text).split(",")]
    except ValueError:
        raise ValueError(f"{key} must be comma-separated {what} such as {example!r}, got {text!r}") from None


def layer_counts(text: str | None) -> list[int] | None:
    """``"3,3,2"`` -> ``[3, 3, 2]`` (None stays None).

    Raises:
        ValueError: naming ``layers_per_stage`` when an entry is not a non-negative integer.
    """
    counts = comma_integers(text, "layers_per_stage", "counts", "3,3,2")
    if counts is not None and (any(count < 0 for count in counts) or not any(counts)):
        raise ValueError(f"layers_per_stage counts must be >= 0 and not all 0, got {text!r}")
    return counts


def stage_indices(text: str | None, key: str = "recompute_stages") -> list[int] | None:
    """``"0,1"`` -> ``[0, 1]`` (None stays None): a recipe's ``key`` (``recompute_stages``, ``coshard_stages``).

    Raises:
        ValueError: naming ``key`` when an entry is not a non-negative integer or repeats.
    """
    indices = comma_integers(text, key, "stage indices", "0,1")
    if indices is None:
        return None
    if any(index < 0 for index in indices):
        raise ValueError(f"{key} must be stage indices >= 0 (stage 0 is the first), got {text!r}")
    repeated = sorted({index for index in indices if indices.count(index) > 1})
    if repeated:
        raise ValueError(f"{key} names stage {', '.join(map(str, repeated))} more than once in {text!r}; name each stage once")
    return indices


def three_f_one_b_plan(graph: Graph, ctx: PlanContext, *, stages: int | None = None, microbatches: int | None = None) -> None:
    """3F1B for models with recycling: each no-grad recycling pass is cut into ``stages`` forward-only
    stages, placed like the gradient pass's, and their forwards fill the gradient pass's bubbles."""
    pipeline(graph, ctx, schedule="3f1b", stages=stages, microbatches=microbatches)


def interlaced_plan(
    graph: Graph, ctx: PlanContext, *, stages: int | None = None, microbatches: int | None = None, shared_layers: str | None = None,
) -> None:
    """Interlaced pipeline for large vocabularies: embedding lookups and the vocabulary projection split
    over all ``stages`` ranks, run by every rank between its 1F1B actions (``plans.interlaced``)."""
    names = [name.strip() for name in shared_layers.split(",") if name.strip()] if shared_layers else None
    pipeline(graph, ctx, schedule="interlaced", stages=stages, microbatches=microbatches, shared_layers=names)


def hybrid3d(
    graph: Graph, ctx: PlanContext, *, dp: int = 1, tp: int = 1, pp: int = 2, microbatches: int | None = None,
    recompute_stages: str | None = None, coshard_stages: str | None = None, shards: int = 2,
) -> None:
    """dp × tp × pp: ``dp`` replicas, each a 1F1B pipeline of ``pp`` stages, each stage Megatron-split over ``tp`` ranks."""
    pipeline(graph, ctx, schedule="1f1b", stages=pp, microbatches=microbatches, dp=dp, tp=tp, recompute_stages=stage_indices(recompute_stages),
             **_coshard(coshard_stages, shards))


def _coshard(coshard_stages: str | None, shards: int) -> dict[str, Any]:
    """The ``pipeline`` arguments of a recipe's ``coshard_stages`` and ``shards``."""
    return {"coshard_stages": stage_indices(coshard_stages, "coshard_stages"), "shards": shards}


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


def pipeline(
    graph: Graph, ctx: PlanContext, *, schedule: str, stages: int | None = None, microbatches: int | None = None,
    virtual_stages: int = 1, dp: int | None = None, tp: int = 1, shared_layers: Sequence[str] | None = None,
    layers_per_stage: Sequence[int] | None = None, recompute_stages: Sequence[int] | None = None,
    coshard_stages: Sequence[int] | None = None, shards: int = 2, schedule_csv: str | None = None,
) -> None:
    """Plan ``graph`` as a pipeline (see the module docstring); sets ``ctx.pipeline``.

    Args:
        schedule: One of ``SCHEDULES`` (``zbv``, ``vhalf``: V-shaped, two stages per rank, ``schedules.v_shape``).
        stages: Pipeline ranks per replica (default: ``world_size / (dp × tp)``).
        microbatches: Per replica and step (default: the smallest divisor of the replica's batch
            that is at least ``stages``).
        virtual_stages: Model chunks per rank (interleaved only).
        dp: Data-parallel replicas (default: ``world_size / (stages × tp)``).
        tp: Tensor-parallel ranks per stage.
        shared_layers: Interlaced only: the op names of the layers split by vocabulary over all the
            pipeline's ranks (default: found from the graph, see ``plans.interlaced``).
        layers_per_stage: How many of the model's layers each stage (each chunk, for interleaved:
            ``stages × virtual_stages`` counts) holds, instead of cuts balanced by cost (see ``model_layers``).
        recompute_stages: Pipeline ranks (0 … stages - 1) whose activations are recomputed in backward
            (``recompute_segments``); for interleaved, every chunk of each named rank. Not for 3f1b or interlaced.
        coshard_stages: Pipeline ranks whose segments are co-sharded: Megatron splits cut into ``shards`` pieces
            per rank (times ``tp``), run one after another, each recomputed alone (``plans.coshard``). Not
            for 3f1b or interlaced, nor for a stage also in ``recompute_stages``.
        shards: Pieces per rank of each split on the ``coshard_stages`` (at least 2).
        schedule_csv: A per-rank action table in torch.distributed.pipelining's CSV format run instead of
            ``schedule``'s generator (``imported_schedule``); it fixes the microbatches and the stages per rank.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline: schedule must be one of {SCHEDULES}, got {schedule!r}")
    _refuse_sync_batch_norm(graph, schedule)
    for key, named in (("recompute_stages", recompute_stages), ("coshard_stages", coshard_stages)):
        if named and schedule in ("3f1b", "interlaced"):
            raise ValueError(
                f"{schedule}: {key} is not supported (its forward-only or shared stages are not one rank's own); "
                "use it with gpipe, 1f1b, zb1, interleaved or hybrid3d"
            )
    if coshard_stages and (not isinstance(shards, int) or isinstance(shards, bool) or shards < 2):
        raise ValueError(f"pipeline: shards must be an int >= 2 for coshard_stages {list(coshard_stages)}, got {shards!r}")
    if schedule == "3f1b":
        virtual_stages = count_recycles(graph)
    elif schedule != "interleaved" and virtual_stages != 1:
        raise ValueError(f"pipeline: virtual_stages={virtual_stages} needs schedule='interleaved'")
    if schedule in V_SCHEDULES:
        virtual_stages = 2  # the V: its generated order is placed like an imported table's (by its stage_ranks)
    if layers_per_stage is not None and schedule in ("3f1b", "interlaced"):
        raise ValueError(f"{schedule}: layers_per_stage is not supported (its stages are cut by cost)")
    if schedule == "interlaced" and tp != 1:
        raise ValueError(f"interlaced: tp={tp} is not supported (its shared layers are already split over every pipeline rank)")
    pp = stages if stages is not None else ctx.world_size // ((dp or 1) * tp)  # stages=0 is refused below, never read as "all"
    dp = dp if dp is not None else ctx.world_size // max(pp * tp, 1)
    if min(pp, dp, tp) < 1 or dp * pp * tp != ctx.world_size:
        raise ValueError(f"pipeline: dp ({dp}) × stages ({pp}) × tp ({tp}) must equal world_size ({ctx.world_size})")
    _check_stage_indices(recompute_stages, pp)
    _check_stage_indices(coshard_stages, pp, "coshard_stages")
    both = sorted(set(recompute_stages or ()) & set(coshard_stages or ()))
    if both:
        raise ValueError(
            f"pipeline: stage {', '.join(map(str, both))} is in both recompute_stages and coshard_stages; "
            "a co-sharded stage already recomputes, one shard at a time: name it in one of them"
        )
    imported = imported_schedule(schedule, schedule_csv, pp, microbatches) if schedule_csv is not None else None
    if imported is not None:
        microbatches, virtual_stages = imported.microbatches, imported.stages // pp
    batch = _batch_rows(graph)
    if batch % dp:
        raise ValueError(f"pipeline: the batch ({batch} rows) must divide into {dp} data-parallel replicas")
    multiple_of = pp if virtual_stages > 1 and imported is None and schedule not in V_SCHEDULES else 1
    chosen = microbatches is None
    if chosen:
        microbatches = default_microbatches(batch // dp, pp, multiple_of=multiple_of)
    check_microbatches(schedule, batch // dp, microbatches, multiple_of, chosen=chosen)
    order = imported or _schedule(schedule, pp, microbatches, virtual_stages)
    validate(lower(order))
    shared = None
    if schedule == "interlaced":
        shared = find_shared_layers(graph, _kinds(graph, list(graph.ops), {output.name: op for op in graph.ops for output in op.outputs}), shared_layers)
        shared = vocabulary_parallel_losses(graph, gather_lookups(graph, shared))
        fixed = {name: 0 for name in shared.input_stage} | {name: pp + 1 for name in shared.output_stage}
        cut = cut_stages(graph, pp, fixed=fixed, first=1)
    else:
        cut = cut_stages(graph, pp * virtual_stages, forward_only=order.forward_only, layers_per_stage=layers_per_stage)
    grid = DeviceGrid.of(dp=dp, pp=pp, tp=tp)
    choose = megatron_choice(graph) if tp > 1 or coshard_stages else None
    origins = [op.name for op in graph.ops]
    pieces = split_batch(graph, dp * microbatches)
    check_microbatches_split(pieces)
    vocabulary_split: dict[tuple[int, int], list[str]] = {}  # (replica, microbatch) -> its output-stage ops to walk
    for index, name in enumerate(origins):
        for part, piece in enumerate(pieces[index]):
            replica, microbatch = divmod(part, microbatches)
            stage = cut.stage_of[name]
            segment = PROLOGUE if stage == PROLOGUE_STAGE else (stage, microbatch)
            placing = stage if stage != PROLOGUE_STAGE else cut.first_reader_stage(name)
            if order.is_shared(placing):
                if stage == pp + 1 and name not in shared.hand_ins:
                    vocabulary_split.setdefault((replica, microbatch), []).append(piece.name)
                else:
                    place_shared(graph, piece, shared, [_rank(grid, replica, column, 0) for column in range(pp)], segment)
                continue
            column = order.stage_ranks[placing]
            ranks = [_rank(grid, replica, column, position) for position in range(tp)]
            placed = op_assign(graph, piece, ranks[0], segment=segment)  # with tp > 1, split over the stage's ranks below
            if 0 <= stage < order.forward_only and not placed.no_grad:  # a recycling stage: no gradient flows through it
                graph.replace_op(placed, [placed.evolve(no_grad=True)])
    for (replica, microbatch), names in vocabulary_split.items():
        ranks = [_rank(grid, replica, column, 0) for column in range(pp)]
        walk = propagate(graph, pp, ops=names, choose=vocabulary_choice(shared))
        for split in walk.split:
            for piece, rank in zip(split, ranks):
                op_assign(graph, piece, rank, segment=(pp + 1, microbatch))
        for whole in walk.whole:
            for copy, rank in zip(replicate(graph, whole, pp), ranks):
                op_assign(graph, copy, rank, segment=(pp + 1, microbatch))
    if tp > 1 or coshard_stages:
        _split_stages(graph, tp, grid, order, choose, {column: shards for column in coshard_stages or ()})
    if recompute_stages:
        recompute_segments(graph, order, recompute_stages)
    ctx.pipeline = PipelinePlan(order, tuple(grid.coordinate(rank, "pp") for rank in range(ctx.world_size)))
    order_forwards(graph, ctx.pipeline)


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


def _check_stage_indices(named: Sequence[int] | None, stages: int, key: str = "recompute_stages") -> None:
    """Raises ValueError naming ``key`` (``recompute_stages``, ``coshard_stages``) when a stage is out of range or named twice."""
    if not named:
        return
    indices = list(named)
    if any(isinstance(index, bool) or not isinstance(index, int) for index in indices):
        raise ValueError(f"pipeline: {key} must be stage indices (ints), got {indices!r}")
    outside = [index for index in indices if not 0 <= index < stages]
    if outside:
        raise ValueError(
            f"pipeline: {key} {indices} names stage {', '.join(map(str, outside))}, outside the pipeline's "
            f"{stages} stages (0 to {stages - 1}; for interleaved, a stage is a pipeline rank and all its chunks)"
        )
    if len(set(indices)) != len(indices):
        raise ValueError(f"pipeline: {key} {indices} names a stage more than once; name each stage once")


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


def check_microbatches_split(pieces: list[list[Op]]) -> None:
    """Refuse an op left whole by the batch split that reads a tensor the split cut into microbatches:
    each microbatch's copy would need every microbatch's rows, so no schedule could run them apart.

    Raises:
        ValueError: naming the op, its operator and the tensor.
    """
    split = {output.name for copies in pieces if len({copy.outputs[0].index for copy in copies if copy.outputs}) > 1 for output in copies[0].outputs}
    for copies in pieces:
        if len(copies) < 2 or len({tuple((piece.index, piece.value) for piece in copy.tensor_inputs) for copy in copies}) > 1:
            continue
        read = next((piece.name for piece in copies[0].tensor_inputs if piece.name in split), None)
        if read is not None:
            op = copies[0]
            fix = (
                f"Register a dimension annotation for {op.target} (lightning_nnscaler.register_annotation)" if op.annotation is None
                else f"Its annotation {op.annotation!r} keeps the batch dim of %{read} whole (^); if this call is exact per batch row, "
                f"register one that lets it split (lightning_nnscaler.register_annotation({op.target!r}))"
            )
            raise ValueError(
                f"pipeline: op {op.source_name!r} ({op.target}) cannot be split along the batch, so each microbatch would "
                f"read every microbatch's rows of %{read}; a pipeline needs every op on the batch's path to split by batch. "
                f"{fix}, or use a recipe without microbatches (dp, tp)"
            )


def _refuse_sync_batch_norm(graph: Graph, schedule: str) -> None:
    """A pipeline runs a microbatch's forward before the next arrives: statistics over the whole batch cannot be had."""
    synced = [op.name for op in graph.ops if op.target == SYNC_MOMENTS]
    if synced:
        raise ValueError(
            f"{schedule}: nn.SyncBatchNorm ({', '.join(synced)}) needs statistics over the whole batch, but a pipeline "
            "runs each microbatch's forward before the next microbatch's: use nn.BatchNorm (statistics per microbatch, as "
            "torch.distributed.pipelining computes them), or a recipe without a pipeline (dp, zero1, zero3)"
        )


def check_microbatches(schedule: str, rows: int, microbatches: int, multiple_of: int = 1, *, chosen: bool = False) -> None:
    """Raise unless ``microbatches`` (``chosen`` by default, or given) is at least 1, divides a replica's
    ``rows`` and is a multiple of ``multiple_of`` (interleaved and 3f1b run microbatches in groups of
    one per pipeline rank).

    Raises:
        ValueError: naming the replica's batch size, the microbatches and the fixes: a larger batch_size,
            fewer microbatches (None picks a divisor for each batch) or ``DataLoader(drop_last=True)``
            when only the last batch is smaller.
    """
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise ValueError(f"{schedule}: microbatches must be an int >= 1, or None for the default, got {microbatches!r}")
    fits = [count for count in range(1, rows + 1) if rows % count == 0 and count % multiple_of == 0]
    if microbatches in fits:
        return
    batch = f"each replica's batch ({rows} row{'s' * (rows != 1)})"
    grouped = f" and be a multiple of the {multiple_of} pipeline ranks (microbatches divisible by ranks: one per rank in each group)" if multiple_of > 1 else ""
    last = "or DataLoader(drop_last=True) if only the last batch is smaller"
    if chosen:  # the default found no count that fits
        raise ValueError(
            f"{schedule}: {batch} cannot be cut into microbatches: they must divide it{grouped}, and no number does. "
            f"Use a larger batch_size (a multiple of {multiple_of} rows per replica), {last}"
        )
    raise ValueError(
        f"{schedule}: microbatches ({microbatches}) must divide {batch}{grouped}: {f'one of {fits}' if fits else 'no number does'}. "
        f"Use a larger batch_size (a multiple of {math.lcm(microbatches, multiple_of)} rows per replica), fewer microbatches "
        f"(or None, which picks one for each batch), {last}"
    )


def default_microbatches(rows: int, stages: int, multiple_of: int = 1) -> int:
    """The smallest divisor of ``rows`` that is at least ``stages`` and a multiple of ``multiple_of``
    (``rows`` when none is)."""
    return next((count for count in range(stages, rows + 1) if rows % count == 0 and count % multiple_of == 0), rows)


def count_recycles(graph: Graph) -> int:
    """How many passes a recycling model runs: 1 + the no-grad reads of its parameters per gradient-pass read.

    Raises:
        ValueError: when no op on the batch's path runs under ``torch.no_grad()`` (nothing recycles).
    """
    reads: dict[str, list[int]] = {}
    for op in graph.ops:
        for piece in op.tensor_inputs:
            if graph.tensors[piece.name].role == "parameter":
                counts = reads.setdefault(piece.name, [0, 0])
                counts[op.no_grad] += 1
    ratios = [no_grad / grad for grad, no_grad in reads.values() if grad and no_grad]
    if not ratios:
        raise ValueError(
            "3f1b: the model has no recycling passes (no op reading a parameter runs under torch.no_grad()); "
            "use 1f1b, or recycle as AlphaFold2 does: r - 1 passes under torch.no_grad(), then one with gradients"
        )
    return 1 + round(sum(ratios) / len(ratios))


def _schedule(name: str, stages: int, microbatches: int, virtual_stages: int) -> Schedule:
    if name in V_SCHEDULES:
        return V_SCHEDULES[name](stages, microbatches)
    if name == "gpipe":
        return gpipe(stages, microbatches)
    if name == "1f1b":
        return one_f_one_b(stages, microbatches)
    if name == "zb1":
        return zb1(stages, microbatches)
    if name == "3f1b":
        return three_f_one_b(stages, microbatches, virtual_stages)
    if name == "interlaced":
        return interlaced(stages, microbatches)
    return interleaved(stages, virtual_stages, microbatches)


def imported_schedule(schedule: str, path: str, pp: int, microbatches: int | None) -> Schedule:
    """The table at ``path`` (``schedules.csv_import``: parsed, checked, validated) for ``pp`` pipeline ranks.

    Raises:
        ValueError: naming ``schedule_csv`` when the file cannot be read, the table is malformed or has
            another number of rows or microbatches, its stages do not split evenly over the ranks, or
            ``schedule`` places stages of its own (3f1b, interlaced); ``ScheduleError`` (with the grid) when
            its order cannot run.
    """
    if schedule in ("3f1b", "interlaced"):
        raise ValueError(f"{schedule}: schedule_csv is not supported (its forward-only or shared stages are placed by the recipe)")
    try:
        rows = read_csv(path)
    except OSError as error:
        raise ValueError(f"schedule_csv: cannot read {path!r}: {error}") from None
    order = parse_table(rows, source=f"schedule_csv {path!r}", ranks=pp, microbatches=microbatches)
    if order.stages % pp:
        raise ValueError(f"schedule_csv {path!r}: its {order.stages} stages must split evenly over its {pp} ranks (as many per rank)")
    return order


def _rank(grid: DeviceGrid, replica: int, column: int, position: int) -> int:
    sizes = dict(grid.axes)
    return (replica * sizes["pp"] + column) * sizes["tp"] + position


def _batch_rows(graph: Graph) -> int:
    rows = {tensor.shape[0] for tensor in graph.user_inputs if tensor.shape}
    if len(rows) != 1:
        raise ValueError(f"pipeline: the batch inputs must share one batch size (dim 0), got {sorted(rows)}")
    return rows.pop()


# --- stage cuts ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageCut:
    """Each op of the captured graph -> its stage (``PROLOGUE_STAGE`` for the prologue), and who reads it."""

    stage_of: dict[str, int]
    readers: dict[str, list[str]]

    def first_reader_stage(self, name: str) -> int:
        """Where the prologue op ``name`` runs: the first stage that reads its outputs, through prologue ops.

        An op no stage reads (a logged value computed from the batch: a loss's count of kept targets per
        replica) runs with the prologue op that feeds it, so that the batch columns it shares with a
        stage's op (the targets of the loss) are read on one rank rather than sent to it; with none, stage 0.
        """
        if name not in self._placed:  # asked once per piece of each op: remembered
            stage = self._reading_stage(name)
            if stage is None:
                feeding = [feed for feed in self._feeds.get(name, []) if self.stage_of[feed] == PROLOGUE_STAGE]
                stage = min((self.first_reader_stage(feed) for feed in feeding), default=0)
            self._placed[name] = stage
        return self._placed[name]

    def _reading_stage(self, name: str) -> int | None:
        """The first stage that reads ``name``'s outputs, through prologue ops; None when no stage does."""
        stages = [self.stage_of[reader] if self.stage_of[reader] != PROLOGUE_STAGE else self._reading_stage(reader)
                  for reader in self.readers.get(name, [])]
        return min((stage for stage in stages if stage is not None), default=None)

    @functools.cached_property
    def _placed(self) -> dict[str, int]:
        """``first_reader_stage``'s answers so far."""
        return {}

    @functools.cached_property
    def _feeds(self) -> dict[str, list[str]]:
        """Op name -> the ops whose outputs it reads (``readers`` inverted)."""
        feeds: dict[str, list[str]] = {}
        for producer, readers in self.readers.items():
            for reader in readers:
                feeds.setdefault(reader, []).append(producer)
        return feeds


def cut_stages(
    graph: Graph, stages: int, forward_only: int = 0, fixed: dict[str, int] | None = None, first: int = 0,
    layers_per_stage: Sequence[int] | None = None,
) -> StageCut:
    """Each op of ``graph`` (not yet split) -> its stage (``PROLOGUE_STAGE`` for the prologue).

    With ``layers_per_stage``, stage ``s`` holds the next ``layers_per_stage[s]`` of the model's layers
    (``model_layers``) instead of an equal share of the cost.

    The ops of ``fixed`` keep their given stage; the other ops on the batch's path are cut into
    ``stages`` stages numbered from ``first`` (the interlaced pipeline's shared layers are fixed).

    With ``forward_only`` > 0 (3F1B), the ops running under ``no_grad`` (the recycling passes, which
    must all come before the gradient pass) fill the first ``forward_only`` stages, the others the rest.

    Raises:
        ValueError: when the graph has fewer ops that read activations than ``stages``, or no-grad ops
            after gradient ones with ``forward_only``.
    """
    ops = list(graph.ops)
    producer = {output.name: op for op in ops for output in op.outputs}
    readers: dict[str, list[str]] = {}
    for op in ops:
        for piece in op.tensor_inputs:
            if piece.name in producer:
                readers.setdefault(producer[piece.name].name, []).append(op.name)
    kind = _kinds(graph, ops, producer)
    fixed = fixed or {}
    flowing = [op for op in ops if kind[op.name] == "batch" and op.name not in fixed]
    if len(flowing) < stages:
        raise ValueError(f"pipeline: {stages} stages need at least {stages} ops on the batch's path; the model has {len(flowing)}")
    stage_of: dict[str, int] = {}
    if forward_only:
        flows = _gradient_flows(graph, ops, producer)
        first = next((index for index, op in enumerate(flowing) if flows[op.name]), len(flowing))
        recycling, gradient = flowing[:first], flowing[first:]  # the recycling passes and what hands their state on
        if len(recycling) < forward_only or len(gradient) < stages - forward_only:
            raise ValueError(f"3f1b: {len(recycling)} recycling and {len(gradient)} gradient-pass ops cannot fill {forward_only} and {stages - forward_only} stages")
        parts = [(recycling, forward_only, 0), (gradient, stages - forward_only, forward_only)]
    else:
        parts = [(flowing, stages, first)]
    for part, count, start in parts:
        cuts = _balanced_cuts(part, count) if layers_per_stage is None else _layer_cuts(graph, part, count, layers_per_stage)
        for index, op in enumerate(part):
            stage_of[op.name] = start + sum(index >= cut for cut in cuts)
    stage_of.update(fixed)
    for op in reversed(ops):  # weights-only ops join their first reader's stage
        if kind[op.name] == "weights":
            stage_of[op.name] = min((stage_of[reader] for reader in readers.get(op.name, []) if stage_of.get(reader, -1) >= 0), default=0)
        elif kind[op.name] == "prologue":
            stage_of[op.name] = PROLOGUE_STAGE
    return StageCut(stage_of, readers)


_LAYER = re.compile(r"^(.*\.\d+)\.")


def model_layers(graph: Graph, ops: Sequence[Op]) -> tuple[list[int], int]:
    """Per op of ``ops`` (in order), the index of the layer it belongs to; and how many layers there are.

    A layer is a numbered module (``blocks.3``, ``encoder.layers.0``): the longest prefix of a parameter's
    ``state_dict`` key that ends in a number. An op reading such a parameter belongs to its layer; an op
    reading none (a residual add, an activation) to the layer of the op before it. The embeddings
    before the first layer are layer -1; the head after the last layer (from the first op reading a
    parameter there: a final norm, an LM head) is layer ``count``, so a stage of 0 layers at either end
    holds only the embeddings or the head.
    """
    index_of: dict[str, int] = {}
    layers, current, last_numbered = [], -1, -1
    reads_parameters = []
    for position, op in enumerate(ops):
        keys = [graph.tensors[piece.name].state_key or "" for piece in op.tensor_inputs if graph.tensors[piece.name].role == "parameter"]
        numbered = [match.group(1) for match in map(_LAYER.match, keys) if match]
        if numbered:
            current, last_numbered = index_of.setdefault(numbered[0], len(index_of)), position
        layers.append(current)
        reads_parameters.append(bool(keys))
    head = next((position for position in range(last_numbered + 1, len(ops)) if reads_parameters[position]), None)
    if head is not None:
        layers[head:] = [len(index_of)] * (len(ops) - head)
    return layers, len(index_of)


def _layer_cuts(graph: Graph, ops: Sequence[Op], stages: int, layers_per_stage: Sequence[int]) -> list[int]:
    """Cut indices into ``ops``: stage ``s`` starts at the first op of its first layer.

    Raises:
        ValueError: naming ``layers_per_stage`` when its counts do not give ``stages`` stages of the
            model's layers, or leave a stage without ops.
    """
    layers, count = model_layers(graph, ops)
    if len(layers_per_stage) != stages or sum(layers_per_stage) != count:
        raise ValueError(
            f"pipeline: layers_per_stage {list(layers_per_stage)} must give {stages} stages (chunks) and add up to "
            f"the model's {count} layers (numbered modules such as blocks.0)"
        )
    if any(layers_in_stage == 0 for layers_in_stage in layers_per_stage[1:-1]):
        raise ValueError(
            f"pipeline: layers_per_stage {list(layers_per_stage)}: only the first and the last stage may hold 0 layers "
            "(the embeddings or the head alone)"
        )
    cuts, boundary = [], 0
    for layers_in_stage in layers_per_stage[:-1]:
        boundary += layers_in_stage
        cut = next((index for index, layer in enumerate(layers) if layer >= boundary), None)
        if cut is None or cut == 0 or (cuts and cut <= cuts[-1]):
            raise ValueError(
                f"pipeline: layers_per_stage {list(layers_per_stage)} leaves a stage without ops "
                "(the model has no embeddings before its first layer, or no head after its last)"
            )
        cuts.append(cut)
    return cuts


def _kinds(graph: Graph, ops: list[Op], producer: dict[str, Op]) -> dict[str, str]:
    """Per op: ``prologue`` (no parameter upstream: needs no gradient), ``weights`` (parameters
    upstream but not the batch) or ``batch`` (both: the ops a pipeline's stages cut)."""
    needs_grad: dict[str, bool] = {}
    reads_batch: dict[str, bool] = {}
    kind: dict[str, str] = {}
    for op in ops:
        grad = batch = False
        for piece in op.tensor_inputs:
            if piece.name in producer:
                grad |= needs_grad[producer[piece.name].name]
                batch |= reads_batch[producer[piece.name].name]
            else:
                tensor = graph.tensors[piece.name]
                grad |= tensor.role == "parameter" and tensor.requires_grad
                batch |= tensor.role == "input"
        needs_grad[op.name], reads_batch[op.name] = grad, batch
        kind[op.name] = "prologue" if not grad else "batch" if batch else "weights"
    return kind


def _gradient_flows(graph: Graph, ops: list[Op], producer: dict[str, Op]) -> dict[str, bool]:
    """Per op: whether a gradient flows through it (not under ``no_grad``, reading a trained
    parameter or an output a gradient flows through)."""
    flows: dict[str, bool] = {}
    for op in ops:
        flows[op.name] = not op.no_grad and any(
            flows[producer[piece.name].name] if piece.name in producer
            else graph.tensors[piece.name].role == "parameter" and graph.tensors[piece.name].requires_grad
            for piece in op.tensor_inputs
        )
    return flows


def op_cost(op: Op) -> float:
    """Estimated work of ``op``: the FLOPs of matmuls, attention and convolutions (``ir.work.op_work``, the
    simulator's rule), elements read and written otherwise."""
    work = op_work(op)
    if work.matmul:
        return work.flops
    return float(sum(math.prod(piece.shape) for piece in (*op.outputs, *op.tensor_inputs)))


def _balanced_cuts(ops: Sequence[Op], stages: int) -> list[int]:
    """``stages - 1`` cut indices into ``ops`` of near equal cost, at *light* places where possible.

    Around each target ``k × total / stages`` (within half a stage's cost), a light place is one
    where at most 1.25 times the fewest bytes crossing there cross — between transformer blocks, the
    residual stream alone; the cut goes to the light place nearest the target. Where no place lies
    that near (one op outweighs a stage, e.g. a large vocabulary's head), it goes to the nearest place
    crossing at most 1.25 times the fewest bytes crossing anywhere inside the model (its middle 80 %).
    """
    costs = [op_cost(op) for op in ops]
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    crossing = _crossing_bytes(ops)
    total, cuts, previous = prefix[-1], [], 0
    inner = [crossing[index] for index in range(1, len(ops)) if 0.1 * total <= prefix[index] <= 0.9 * total]
    lightest = min(inner or crossing[1 : len(ops)], default=0)  # inside the model, not the loss's scalars
    for k in range(1, stages):
        target = k * total / stages
        allowed = range(previous + 1, len(ops) - (stages - k) + 1)
        near = [index for index in allowed if abs(prefix[index] - target) <= 0.5 * total / stages]
        bound = 1.25 * (min(crossing[index] for index in near) if near else lightest)
        light = [index for index in (near or allowed) if crossing[index] <= bound]
        best = min(light or allowed, key=lambda index: (abs(prefix[index] - target), crossing[index]))
        cuts.append(best)
        previous = best
    return cuts


def _crossing_bytes(ops: Sequence[Op]) -> list[int]:
    """``crossing[i]``: bytes of the tensors written by ``ops[:i]`` and read by ``ops[i:]``."""
    position = {op.name: index for index, op in enumerate(ops)}
    produced_at = {output.name: (position[op.name], math.prod(output.shape) * dtype_bytes(output.tensor.dtype)) for op in ops for output in op.outputs}
    last_read: dict[str, int] = {}
    for index, op in enumerate(ops):
        for piece in op.tensor_inputs:
            if piece.name in produced_at:
                last_read[piece.name] = index
    delta = [0] * (len(ops) + 2)
    for name, last in last_read.items():
        first, size = produced_at[name]
        delta[first + 1] += size
        delta[last + 1] -= size
    crossing, running = [], 0
    for index in range(len(ops) + 1):
        running += delta[index]
        crossing.append(running)
    return crossing


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

