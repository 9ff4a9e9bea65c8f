"""Plan search (``recipe="auto"``): every catalog recipe over its parameters, each candidate built once from one
traced graph and predicted by the simulator; the fastest that fits the memory limit wins.

A candidate is a recipe and its parameters (``candidates``): data parallelism (dp, ZeRO 1 and 3), tensor
parallelism at each degree (tp, hybrid dp × tp, sp), co-shard (shards, recompute), the pipelines (gpipe, 1f1b,
zb1, zbv, vhalf, dualpipev, interleaved, 3f1b, interlaced: stages, microbatches, virtual stages) and dp × tp × pp
(hybrid3d); 1f1b, zb1 and
hybrid3d also with per-stage choices (``RECOMPUTED_PIPELINES``): the first stage recomputed, every stage, then the
first stage co-sharded (two pieces per rank of each split, each recomputed alone), every stage. Each is planned on a
copy of the graph, checked as ``parallelize`` checks it (the recipe's own ``ValueError``, the coverage check),
materialized, and simulated with ``predict`` on the spec's roofline (deterministic: every rank of a run
searches alike and gets the same plan). A candidate that cannot be built, or whose predicted peak exceeds the
limit on some rank, stays in the result with the reason. The per-stage variants form two chains from the plain
plan, recompute and co-shard, each first stage, then every stage; a variant is only built when the one before it
in its chain (the plain plan first) is over the limit: each adds time and saves memory over the one before, so
where that one fits, it is faster.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_nnscaler.explain import human_bytes, memory_rows
from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.materialize.dependencies import materialize
from lightning_nnscaler.materialize.program import Program
from lightning_nnscaler.materialize.steps import step_program
from lightning_nnscaler.plans.catalog import apply_recipe
from lightning_nnscaler.plans.context import PipelinePlan
from lightning_nnscaler.plans.coverage import check_coverage
from lightning_nnscaler.plans.layout import RecipeLayout
from lightning_nnscaler.plans.propagate import recording_refusals
from lightning_nnscaler.program import BUCKET_BYTES, Program as StepProgram
from lightning_nnscaler.sim.predict import DeviceModel, predict
from lightning_nnscaler.sim.specs import HardwareSpec, load_spec

FAMILIES = (
    "dp", "zero1", "zero3", "tp", "sp", "hybrid", "coshard", "gpipe", "1f1b", "zb1", "zbv", "vhalf", "dualpipev", "interleaved", "3f1b",
    "interlaced", "hybrid3d",
)
"""The catalog recipes the search explores, cheapest to plan first (ties in predicted time keep this order)."""
MICROBATCH_CHOICES = 3  # per stage count: the smallest divisors of the replica's batch that are >= stages
RECOMPUTED_PIPELINES = ("1f1b", "zb1", "hybrid3d")
"""Searched with per-stage choices too (``STAGE_OPTIONS``): recomputed, then co-sharded, the first stage (under 1F1B
stage r stashes p - r microbatches) and every stage."""
STAGE_OPTIONS = ("recompute_stages", "coshard_stages", "shards")
"""The per-stage parameters of a pipeline candidate; without them it is the plain plan."""
COSHARD_SHARDS = 2


@dataclass(frozen=True)
class Candidate:
    """A recipe and its parameters."""

    recipe: str
    params: tuple[tuple[str, Any], ...] = ()

    @property
    def kwargs(self) -> dict[str, Any]:
        """The parameters as keyword arguments."""
        return dict(self.params)

    def __str__(self) -> str:
        return " ".join([self.recipe, *(f"{key}={value}" for key, value in self.params)])

    @property
    def chain(self) -> str | None:
        """Which per-stage chain the candidate belongs to (``recompute``, ``coshard``); None for a plain plan."""
        kwargs = self.kwargs
        return "recompute" if "recompute_stages" in kwargs else "coshard" if "coshard_stages" in kwargs else None

    @property
    def plain(self) -> Candidate | None:
        """For a candidate with per-stage choices (``STAGE_OPTIONS``), the same one without them; None for the others."""
        if not any(key in STAGE_OPTIONS for key in self.kwargs):
            return None
        return Candidate(self.recipe, tuple((key, value) for key, value in self.params if key not in STAGE_OPTIONS))


@dataclass
class BuiltPlan:
    """A candidate planned and materialized: what ``predict`` reads of a ``Plan`` (no code generated)."""

    graph: Graph
    planned: Graph
    materialized: Program
    program: StepProgram
    layout: RecipeLayout
    zero_stage: int = 0
    pipeline: PipelinePlan | None = None

    def memory_rows(self) -> list[dict[str, int]]:
        """Per rank, ``explain.memory_rows`` (as ``Plan.memory_rows``)."""
        return memory_rows(self.materialized, self.graph.parameters, self.pipeline, zero_stage=self.zero_stage, step=self.program)


@dataclass
class Outcome:
    """One candidate's prediction, or why it was left out."""

    candidate: Candidate
    step_seconds: float | None = None
    peak_bytes: int | None = None
    reason: str = ""
    """Empty when the candidate fits; otherwise why not (cannot be built, over the memory limit)."""
    built: BuiltPlan | None = field(default=None, repr=False)

    @property
    def fits(self) -> bool:
        """Built, predicted and within the memory limit."""
        return not self.reason


@dataclass
class SearchResult:
    """The ranked candidates: those that fit by predicted step time, then the others with their reasons."""

    world_size: int
    spec_name: str
    memory_limit_bytes: float
    outcomes: list[Outcome]
    seconds: float = 0.0
    """Wall seconds the search took."""

    @property
    def ranked(self) -> list[Outcome]:
        """The candidates that fit, fastest first."""
        return [outcome for outcome in self.outcomes if outcome.fits]

    @property
    def rejected(self) -> list[Outcome]:
        """The candidates that do not fit, each with its reason."""
        return [outcome for outcome in self.outcomes if not outcome.fits]

    @property
    def best(self) -> Outcome:
        """The fastest candidate that fits.

        Raises:
            ValueError: no candidate fits (the reasons of the first few are in the message).
        """
        if not self.ranked:
            reasons = "; ".join(f"{outcome.candidate}: {outcome.reason}" for outcome in self.rejected[:6])
            raise ValueError(
                f"auto: no candidate plan fits {self.world_size} ranks of {self.spec_name} under {human_bytes(self.memory_limit_bytes)} "
                f"per device ({len(self.outcomes)} tried; {reasons}). Raise memory_limit_gb, widen recipes, or change world_size."
            )
        return self.ranked[0]

    @property
    def layout(self) -> RecipeLayout:
        """The winner's own layout (its device grid and head pieces)."""
        built = self.best.built
        assert built is not None  # a candidate that fits was built
        return built.layout

    def summary(self) -> str:
        """One line: the winner, its predicted step and peak, and what was searched."""
        best = self.best
        assert best.step_seconds is not None and best.peak_bytes is not None
        return (
            f"searched: {best.candidate} — predicted {best.step_seconds * 1e3:.3f} ms/step, peak {human_bytes(best.peak_bytes)} per rank "
            f"on {self.spec_name}; {len(self.ranked)} of {len(self.outcomes)} candidates fit {human_bytes(self.memory_limit_bytes)} "
            f"per device (search {self.seconds:.1f} s)"
        )

    def table(self, limit: int | None = None) -> str:
        """The ranked table (recipe and parameters, predicted ms, peak memory, × the winner's time, fits or why not)."""
        lines = [f"{'#':>3} {'candidate':<52} {'ms/step':>10} {'× best':>7} {'peak/rank':>11}  fits"]
        best = self.ranked[0].step_seconds if self.ranked else None
        for index, outcome in enumerate(self.outcomes[:limit]):
            time_text = f"{outcome.step_seconds * 1e3:10.3f}" if outcome.step_seconds is not None else f"{'—':>10}"
            ratio = f"{outcome.step_seconds / best:7.2f}" if outcome.step_seconds is not None and best else f"{'—':>7}"
            peak = human_bytes(outcome.peak_bytes) if outcome.peak_bytes is not None else "—"
            lines.append(f"{index + 1:>3} {str(outcome.candidate):<52} {time_text} {ratio} {peak:>11}  {outcome.reason or 'yes'}")
        if limit is not None and len(self.outcomes) > limit:
            lines.append(f"    ... {len(self.outcomes) - limit} more")
        return "\n".join(lines)


def parse_recipes(recipes: str | Sequence[str] | None) -> tuple[str, ...]:
    """The families to search: ``recipes`` as a comma-separated string or a sequence of names (None: all).

    Raises:
        ValueError: naming the ``recipes`` key and the unknown name.
    """
    if recipes is None:
        return FAMILIES
    names = [name.strip() for name in recipes.split(",")] if isinstance(recipes, str) else list(recipes)
    names = [name for name in names if name]
    unknown = [name for name in names if name not in FAMILIES]
    if unknown or not names:
        raise ValueError(
            f"auto: recipes={recipes!r} names {', '.join(map(repr, unknown)) or 'no recipe'}; the searchable recipes are "
            f"{', '.join(FAMILIES)} (a comma-separated string, e.g. recipes='dp,tp,1f1b')"
        )
    return tuple(dict.fromkeys(names))


def memory_limit(spec: HardwareSpec, memory_limit_gb: float | None) -> float:
    """Bytes per device: ``memory_limit_gb`` (GB = 1e9 bytes) or the spec's device memory.

    Raises:
        ValueError: naming ``memory_limit_gb`` when it is not a positive number.
    """
    if memory_limit_gb is None:
        return spec.memory_bytes
    if isinstance(memory_limit_gb, bool) or not isinstance(memory_limit_gb, (int, float)) or not memory_limit_gb > 0:
        raise ValueError(f"auto: memory_limit_gb must be a positive number of GB (1e9 bytes) per device, got {memory_limit_gb!r}")
    return float(memory_limit_gb) * 1e9


def divisors(number: int) -> list[int]:
    """The positive divisors of ``number``, ascending."""
    return [value for value in range(1, number + 1) if number % value == 0]


def candidates(world_size: int, batch_rows: int, families: Sequence[str] = FAMILIES, *, max_pp: int | None = None) -> list[Candidate]:
    """Every candidate for ``world_size`` ranks and a batch of ``batch_rows``: degrees that divide the ranks,
    microbatch counts that divide a replica's batch (the ``MICROBATCH_CHOICES`` smallest at least the stage
    count), ``max_pp`` bounding the pipeline stages; each of ``RECOMPUTED_PIPELINES`` followed by its variants
    recomputing the first stage and every stage. Whether a candidate fits the model is the build's to say."""
    splits = [value for value in divisors(world_size) if value > 1]
    stage_counts = [value for value in splits if max_pp is None or value <= max_pp]
    found: list[Candidate] = []

    def add(recipe: str, **params: Any) -> None:
        if recipe in families:
            found.append(Candidate(recipe, tuple(params.items())))
            if recipe in RECOMPUTED_PIPELINES:
                stages = params.get("pp") or params["stages"]
                for named in ("0", ",".join(map(str, range(stages)))):
                    found.append(Candidate(recipe, (*params.items(), ("recompute_stages", named))))
                for named in ("0", ",".join(map(str, range(stages)))):
                    found.append(Candidate(recipe, (*params.items(), ("coshard_stages", named), ("shards", COSHARD_SHARDS))))

    def microbatches(replicas: int, stages: int, multiple_of: int = 1) -> list[int]:
        rows = batch_rows // replicas if batch_rows % replicas == 0 else 0
        counts = [value for value in divisors(rows) if value >= stages and value % multiple_of == 0] if rows else []
        return counts[:MICROBATCH_CHOICES]

    for recipe in ("dp", "zero1", "zero3", "sp"):
        add(recipe)
    for degree in splits:
        add("tp", degree=degree)
    for tp in splits[:-1]:  # dp × tp with both above 1 (tp at every degree is above)
        add("hybrid", dp=world_size // tp, tp=tp)
    for shards in (2, 4):
        for recompute in (True, False):
            add("coshard", shards=shards, recompute=recompute)
    for stages in stage_counts:
        replicas = world_size // stages
        for recipe in ("gpipe", "1f1b", "zb1", "zbv", "vhalf", "interlaced"):
            for count in microbatches(replicas, stages):
                add(recipe, stages=stages, microbatches=count)
        for count in microbatches(replicas, 2 * stages):  # DualPipeV: at least one microbatch per stage of the V
            add("dualpipev", stages=stages, microbatches=count)
        for count in microbatches(replicas, stages, multiple_of=stages):
            add("interleaved", stages=stages, microbatches=count, virtual_stages=2)
            add("3f1b", stages=stages, microbatches=count)
    for pp in stage_counts:
        for tp in [value for value in splits if world_size % (pp * value) == 0]:
            dp = world_size // (pp * tp)
            for count in microbatches(dp, pp):
                add("hybrid3d", dp=dp, tp=tp, pp=pp, microbatches=count)
    return found


def build(graph: Graph, world_size: int, candidate: Candidate) -> BuiltPlan:
    """Plan ``graph`` (left unchanged) with ``candidate``, check it as ``parallelize`` does, and materialize it.

    Raises:
        ValueError: the recipe does not fit (its own check, ``RecipeError``, ``PlanError``, a coverage refusal).
    """
    planned = graph.copy()
    with recording_refusals(isolated=True) as refusals:
        context = apply_recipe(planned, candidate.recipe, world_size, **candidate.kwargs)
    assert context.layout is not None  # apply_recipe always sets it
    check_coverage(planned, graph, world_size, recipe=candidate.recipe, refusals=refusals,
                   model_parallel=world_size // context.layout.data_parallel)
    program = materialize(planned, world_size, validate=False)
    lists = [context.pipeline.actions(rank) for rank in range(world_size)] if context.pipeline else None
    dtypes = {tensor.name: tensor.dtype for tensor in graph.parameters}
    steps = step_program(program, lists, dtypes, zero_stage=context.zero_stage, bucket_bytes=BUCKET_BYTES)
    return BuiltPlan(graph, planned, program, steps, context.layout, context.zero_stage, context.pipeline)


def batch_rows(graph: Graph) -> int:
    """The batch size: dim 0 of the graph's batch inputs.

    Raises:
        ValueError: the graph has no batch input, or its inputs disagree on dim 0.
    """
    rows = {tensor.shape[0] for tensor in graph.user_inputs if tensor.shape}
    if len(rows) != 1:
        raise ValueError(f"auto: the batch inputs must share one batch size (dim 0) for the search, got {sorted(rows)}")
    return rows.pop()


def search(
    graph: Graph, world_size: int, *, spec: HardwareSpec | str = "cpu", memory_limit_gb: float | None = None,
    recipes: str | Sequence[str] | None = None, max_pp: int | None = None, device: DeviceModel | None = None,
) -> SearchResult:
    """Build and predict every candidate (``candidates``) of ``graph`` on ``world_size`` ranks of ``spec``.

    Args:
        graph: The traced graph (``lnn.trace`` / the step's graph); it is not changed.
        world_size: Ranks.
        spec: Hardware spec name or YAML path (``sim.specs``).
        memory_limit_gb: Per-device limit in GB (default: the spec's device memory).
        recipes: Families to search (names of ``FAMILIES``, a list or a comma-separated string; default all).
        max_pp: Most pipeline stages a candidate may have.
        device: Op costs (default: the spec's roofline, the same on every rank).

    Raises:
        ValueError: a bad ``recipes``, ``memory_limit_gb``, ``max_pp`` or ``world_size``, naming the key.
    """
    start = time.perf_counter()
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"auto: world_size must be a positive int, got {world_size!r}")
    if max_pp is not None and (isinstance(max_pp, bool) or not isinstance(max_pp, int) or max_pp < 1):
        raise ValueError(f"auto: max_pp must be a positive int (most pipeline stages) or None, got {max_pp!r}")
    families = parse_recipes(recipes)
    hardware = load_spec(spec) if isinstance(spec, str) else spec
    limit = memory_limit(hardware, memory_limit_gb)
    outcomes: list[Outcome] = []
    saving_less: dict[tuple[Candidate, str | None], Outcome] = {}  # (plain plan, chain) -> the chain's latest outcome
    for candidate in candidates(world_size, batch_rows(graph), families, max_pp=max_pp):
        plain, chain = candidate.plain, candidate.chain
        less = saving_less.get((plain, chain)) or saving_less.get((plain, None))
        unneeded = _variant_unneeded(less) if less is not None else ""
        outcome = Outcome(candidate, reason=unneeded) if unneeded else _evaluate(graph, world_size, candidate, hardware, limit, device)
        saving_less[plain or candidate, chain] = outcome
        outcomes.append(outcome)
    order = {outcome.candidate: index for index, outcome in enumerate(outcomes)}
    outcomes.sort(key=lambda outcome: (not outcome.fits, outcome.step_seconds if outcome.step_seconds is not None else float("inf"),
                                       order[outcome.candidate]))
    return SearchResult(world_size, hardware.name, limit, outcomes, time.perf_counter() - start)


def _evaluate(graph: Graph, world_size: int, candidate: Candidate, spec: HardwareSpec, limit: float,
              device: DeviceModel | None) -> Outcome:
    """``candidate`` built and predicted, or the reason it cannot be."""
    try:
        built = build(graph, world_size, candidate)
    except ValueError as error:
        return Outcome(candidate, reason=f"cannot build: {_first_line(error)}")
    prediction = predict(built, spec, device)
    peaks = prediction.peak_bytes
    outcome = Outcome(candidate, prediction.step_seconds, max(peaks), built=built)
    if outcome.peak_bytes is not None and outcome.peak_bytes > limit:
        rank = peaks.index(outcome.peak_bytes)
        outcome.reason = f"peak {human_bytes(outcome.peak_bytes)} on rank {rank} is over the {human_bytes(limit)} limit"
    return outcome


def _variant_unneeded(less: Outcome) -> str:
    """Why a per-stage variant is not built (empty: build it), from ``less``, the variant before it (saving less memory)."""
    if less.fits:
        return f"not built: {less.candidate} fits the limit saving less memory, and each saving adds time"
    if less.built is None:
        return less.reason if less.reason.startswith("not built") else f"not built: {less.candidate} cannot be built"
    return ""


def _first_line(error: Exception) -> str:
    """The error's first line, shortened for a table cell."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text if len(text) <= 160 else text[:157] + "..."
