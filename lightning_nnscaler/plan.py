"""``parallelize``: module + example inputs + recipe -> a Plan (graph, per-rank code, checks)."""

from __future__ import annotations

import contextlib
import gc
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from lightning_nnscaler.capture import bind_inputs, trace
from lightning_nnscaler.capture.step_values import StepValues
from lightning_nnscaler.replica_buffers import ReplicaBufferUpdates, replica_buffer_updates
from lightning_nnscaler.capture.trace import TracedStep, trace_step
from lightning_nnscaler.codegen import module_from_source, save_sources
from lightning_nnscaler.codegen.sources import Lowered, RankSources
from lightning_nnscaler.codegen.load import digest
from lightning_nnscaler.explain import explain_table, memory_rows
from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir.op import PROLOGUE
from lightning_nnscaler.ir.randomness import current_stream
from lightning_nnscaler.ir.validate import PlanError
from lightning_nnscaler.logged_values import KeptTargets, LoggedValues, kept_targets, plan_logged_values
from lightning_nnscaler.materialize.dependencies import materialize
from lightning_nnscaler.materialize.program import Compute, Program
from lightning_nnscaler.materialize.steps import check_message_order, step_program
from lightning_nnscaler.plans.context import PipelinePlan
from lightning_nnscaler.plans.layout import RecipeLayout, single_replica
from lightning_nnscaler.plans.stage_cuts import OpPrices
from lightning_nnscaler.program import BUCKET_BYTES, Program as StepProgram
from lightning_nnscaler.runtime.comm import Communicator
from lightning_nnscaler.runtime.executor import RankExecutor, merge_gradients
from lightning_nnscaler.schedules import Durations, bubble_fraction, execute, grid, lower, theoretical_bubble_fraction, validate
from lightning_nnscaler.verify import EquivalenceError, evaluate, replica_reference

CODEGEN_VERSION = "8"  # 8: PROGRAM (the step's actions) and BUCKETS replace SCHEDULE

@dataclass
class VerifyReport:
    """What ``Plan.verify`` compared: the loss, the largest gradient difference and the logged values' sums."""

    world_size: int
    loss: float
    reference_loss: float
    max_gradient_difference: float
    parameters_checked: int
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    """The graph outputs besides the loss as the ranks summed them (``plan.logged.logs(values, replica)``)."""


@dataclass
class Plan:
    """A parallelization plan for one module: the planned graph, the per-rank code and its checks."""

    module: nn.Module
    example_args: Any
    step: str | None
    recipe: str
    params: dict[str, Any]
    world_size: int
    graph: Graph
    planned: Graph
    lowered: Lowered
    """The materialization and the step's program as planned (one rank's alone for ``parallelize(rank=)``), and every rank's
    when first asked for (``materialized``, ``program``)."""
    sources: Sequence[str]
    """Rank ``r``'s module as ``sources[r]`` (``codegen.sources.RankSources``: generated when first read)."""
    plan_hash: str
    zero_stage: int = 0
    layout: RecipeLayout | None = None
    """Which data-parallel replica each rank belongs to, so which batch rows its code reads (one replica
    when None): the recipe's layout, or for ``auto`` its winner's."""
    pipeline: PipelinePlan | None = None
    """A pipelined plan's schedule (None: one forward and one backward per rank)."""
    _reference: Any = field(default=None, repr=False)
    step_values: StepValues = field(default_factory=StepValues)
    """The plain attributes the traced training_step read (``check(module)`` before each step), its guards on
    per-step values and the constants that carry them (none for forward)."""
    logged: LoggedValues | None = None
    """What the traced training_step logs and how each rank computes its replica's values (None for forward)."""
    replica_buffers: ReplicaBufferUpdates | None = None
    """Buffers the step updates by arithmetic, recomputed per data-parallel replica after each step (``replica_buffers``)."""
    search: Any = None
    """For ``recipe="auto"``: the search that chose this plan (``sim.search.SearchResult``: winner and ranked table)."""
    kept_targets: KeptTargets | None = None
    """The losses averaged over their kept targets, counted per loaded replica (``GlobalMeanWarning``); None with one replica."""
    returned: str = "loss"
    """What the traced step returns as graph output 0: ``"loss"`` (training, forward), ``"value"`` (an evaluation
    step's number) or ``"none"`` (an evaluation step that returns None; output 0 is its first logged number)."""

    @property
    def materialized(self) -> Program:
        """Every rank's ops and pieces after dependency materialization (what codegen writes as segment functions)."""
        return self.lowered.whole()[0]

    @property
    def program(self) -> StepProgram:
        """The step: every rank's actions in order and its gradient buckets (``program.Program``), what the runtime runs
        and the simulator prices."""
        return self.lowered.whole()[1]

    @property
    def data_layout(self) -> RecipeLayout:
        """The layout, one replica over every rank when the plan has none."""
        return self.layout or single_replica(self.world_size, {})

    def replica_inputs(self, rank: int, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rank ``rank``'s data-parallel replica's share of whole-batch ``inputs`` (what its DataLoader loads)."""
        layout = self.data_layout
        rows = {tensor.name: tensor.shape[0] // layout.data_parallel for tensor in self.graph.user_inputs if tensor.shape}
        replica = layout.replica(rank)
        return {name: value[replica * rows[name] : (replica + 1) * rows[name]] if name in rows else value for name, value in inputs.items()}

    def save_code(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``rank{r}.py`` for every rank under ``directory/<plan hash>``; returns that folder."""
        return save_sources(directory, self.plan_hash, self.sources)

    def inputs(self) -> dict[str, torch.Tensor]:
        """The example batch by graph input name."""
        values = bind_inputs(self.graph, self.module, self.example_args, step=self.step)
        return {tensor.name: values[tensor.name] for tensor in self.graph.user_inputs}

    def verify(self, *, rtol: float = 1e-5, atol: float = 1e-6, timeout: float = 120.0) -> VerifyReport:
        """Run every rank's generated code in this process (threads, in-memory communication) and
        compare the loss and every parameter gradient with single-device execution.

        Training-mode BatchNorm takes statistics per data-parallel replica, as under ddp (and under a
        pipeline per microbatch): the single device then cuts those ops at the replicas' (microbatches')
        rows (``verify.replica_reference``).

        Raises:
            EquivalenceError: naming the first parameter (or the loss) that differs.
        """
        from lightning_nnscaler.runtime.memory_comm import run_ranks

        graph_inputs = bind_inputs(self.graph, self.module, self.example_args, step=self.step)
        stream = current_stream()  # the reference and every rank draw the same random values
        microbatches = self.pipeline.schedule.microbatches if self.pipeline is not None else 1  # per replica
        reference_graph = replica_reference(self.graph, self.data_layout.data_parallel, microbatches)
        reference = evaluate(reference_graph, graph_inputs, backward_from=self.graph.outputs[:1])  # logged values start no backward
        inputs = self.inputs()
        state = {**dict(self.module.named_parameters(remove_duplicate=False)), **dict(self.module.named_buffers(remove_duplicate=False))}

        def run_rank(communicator: Communicator) -> tuple[float, dict]:
            rank = communicator.rank
            module = module_from_source(self.sources[rank], f"verify_rank{rank}")
            executor = RankExecutor(module, rank, state, self.graph.constant_values, communicator, input_offsets=self.input_offsets(rank))
            loss = executor.forward_backward(self.replica_inputs(rank, inputs), random_stream=stream)
            return float(loss), executor.gradients(), executor.values

        results = run_ranks(self.world_size, run_rank, timeout=timeout)
        reference_loss = float(reference.outputs[self.graph.outputs[0]])
        for rank, (loss, _, values) in enumerate(results):
            if not math.isclose(loss, reference_loss, rel_tol=rtol, abs_tol=atol):
                raise EquivalenceError(f"rank {rank}: loss {loss} differs from the single-device loss {reference_loss}")
            for name in self.graph.outputs[1:]:
                expected = reference.outputs[name].detach().to(torch.float64)
                if name not in values or not torch.allclose(values[name], expected, rtol=rtol, atol=atol):
                    raise EquivalenceError(
                        f"rank {rank}: graph output {name!r} (a logged value's per-replica sums) is {values.get(name)}, "
                        f"single device {expected}"
                    )
        shapes = {tensor.state_key: tensor.shape for tensor in self.graph.parameters}
        merged = merge_gradients([shards for _, shards, _ in results], shapes)
        expected = {self.graph.tensors[name].state_key: grad for name, grad in reference.gradients.items() if self.graph.tensors[name].role == "parameter"}
        worst = 0.0
        for key, grad in expected.items():
            if key not in merged:
                raise EquivalenceError(f"gradient of parameter {key!r} is missing from every rank")
            if not torch.allclose(merged[key], grad, rtol=rtol, atol=atol):
                difference = (merged[key] - grad).abs().max().item()
                raise EquivalenceError(f"gradient of parameter {key!r} differs from single device (max abs difference {difference:.3g})")
            worst = max(worst, (merged[key] - grad).abs().max().item())
        return VerifyReport(self.world_size, results[0][0], reference_loss, worst, len(expected), results[0][2])

    def input_offsets(self, rank: int) -> dict[str, int]:
        """Per batch input, the first row of rank ``rank``'s replica's share in the whole batch."""
        layout = self.data_layout
        replica = layout.replica(rank)
        return {tensor.name: replica * (tensor.shape[0] // layout.data_parallel) for tensor in self.graph.user_inputs if tensor.shape}

    def memory_rows(self) -> list[dict[str, int]]:
        """Per rank, ``explain_rank``: bytes of parameters, gradients, optimizer state (Adam assumed),
        activations and ZeRO's transient full-size tensors, and bytes sent per step (all, and the
        gradient reduction's part). ``explain()``, ``draw()`` and the strategy's logged plan all show these rows."""
        return memory_rows(self.materialized, self.graph.parameters, self.pipeline, zero_stage=self.zero_stage, step=self.program)

    def draw(self, path: str | os.PathLike[str], spec: Any = "a100") -> Path:
        """Write the plan picture to ``path`` (PNG): per-rank predicted memory bars and the simulated
        timeline of one step on the hardware ``spec`` (a shipped spec's name, a YAML path or a
        ``sim.HardwareSpec``; default ``sim.predict``'s): forward, backward (a pipeline's F, B and W by
        name), optimizer, communication and idle spans, with the predicted step time in the title."""
        from lightning_nnscaler.draw import draw_plan  # matplotlib and the simulator only when drawing

        return draw_plan(self, path, spec)

    def explain(self, spec: str | None = None) -> str:
        """The ``memory_rows`` as a table: per rank, parameter, gradient, optimizer (Adam assumed),
        activation and transient bytes, and bytes sent per step; footnotes state the assumptions.

        With ``spec`` (a hardware spec name such as ``"h100"`` or a YAML path, see ``sim.specs``), the
        simulated step on that hardware follows (roofline op costs, α–β communication): per rank its
        busy, communication and idle milliseconds and peak memory, and last the ``Prediction.summary`` line."""
        title = f"plan {self.plan_hash[:12]}: recipe {self.recipe} {self.params} on {self.world_size} ranks" + (
            f", ZeRO stage {self.zero_stage}" if self.zero_stage else ""
        )
        lines = [explain_table(title, self.memory_rows())]
        if self.search is not None:
            lines += ["", self.search.summary(), self.search.table()]
        if self.pipeline is not None:
            lines += ["", explain_pipeline(self.pipeline)]
        if spec is not None:
            from lightning_nnscaler.sim import predict  # the simulator only when asked

            lines += ["", predict(self, spec).table()]
        return "\n".join(lines)


def explain_pipeline(pipeline: PipelinePlan) -> str:
    """The schedule's bubble (formula and symbolic execution: F = 1, B = 2, W = 1 of them) and its
    action grid over the pipeline positions, each action at the step it runs."""
    schedule = pipeline.schedule
    ranks, microbatches = schedule.world_size, schedule.microbatches
    shared = [stage for stage in range(schedule.stages) if schedule.is_shared(stage)]
    virtual = (schedule.stages - len(shared)) // ranks
    durations = Durations()
    timeline = execute(schedule, lambda action: durations.of(action, schedule.splits_backward))
    measured = bubble_fraction(schedule, durations)
    formula = theoretical_bubble_fraction(ranks, microbatches, virtual)
    header = (
        f"pipeline: {schedule.stages} stages on {ranks} positions, {microbatches} microbatches; schedule bubble {measured:.1%} "
        f"(theory: idle share of the action grid below, run with F=1 B=2{' W=1, B split' if schedule.splits_backward else ''} and no "
        f"communication; (p-1)/({'v·' if virtual > 1 else ''}m+p-1) = {formula:.1%})"
    )
    if shared:
        header += (
            f"\nshared stages {' and '.join(map(str, shared))} (interlaced): every position runs its vocabulary slice of them "
            "at the same step, the rows where all columns show the same action"
        )
    return header + _stage_work(pipeline) + "\n" + grid(schedule, timeline)


def _stage_work(pipeline: PipelinePlan) -> str:
    """A line with each cut stage's share of the work its cut balanced, and the slowest stage against the mean."""
    if not pipeline.stage_work:
        return ""
    shares = [share for _, share in pipeline.stage_work]
    priced = "op times measured on the device" if pipeline.priced_by == "measured" else "work estimated from shapes"
    return (
        f"\nstage work ({priced}): " + " / ".join(f"{stage}: {share:.3f}" for stage, share in pipeline.stage_work)
        + f"; the slowest stage {max(shares) * len(shares) / sum(shares):.2f}x the mean (it sets the pipeline's pace)"
    )


def parallelize(
    module: nn.Module, example_args: Any, recipe: str = "dp", world_size: int = 1, *, step: str | None = None,
    batch_idx: int = 0, step_args: tuple = (), communication_cost: Any = None, allow_partial: bool = False, progress: Callable[[str], None] | None = None,
    rank: int | None = None, bucket_bytes: int | None = None, measured_prices: OpPrices | None = None, **params: Any,
) -> Plan:
    """Trace ``module``, apply the catalog recipe ``recipe`` for ``world_size`` ranks, materialize
    and generate per-rank code.

    The plan is never silently weaker than asked: when the recipe cannot split an op it means to
    split (e.g. ``tp`` over 3 ranks of 4 attention heads) it raises a ``RecipeError`` naming the
    module, the dim, its size and the parts (see ``plans.coverage``), and a rank left without work
    raises ``IdleRankError``.

    Args:
        module: The model (a LightningModule with ``step="training_step"``, or any module).
        example_args: Example inputs (or a batch with ``step``).
        recipe: A name from the recipe catalog (``lightning-nnscaler recipes`` lists them).
        world_size: Number of ranks.
        step: ``None`` (forward), ``"training_step"``, or an evaluation step (``"validation_step"``, ``"test_step"``:
            planned forward-only; its first output is the number it returns, else its first logged number).
        batch_idx: The ``batch_idx`` the traced ``training_step`` sees (with the Trainer's step and epoch, if
            any): the plan's guards (``plan.step_values.guards``) are the decisions made at these values.
        step_args: What the step takes after ``batch_idx`` (an evaluation step's ``dataloader_idx``).
        communication_cost: The RVD search's cost model (``materialize.AlphaBeta`` by default).
        allow_partial: Best effort: accept a plan that leaves whole (replicated) ops the recipe
            means to split, with a ``PartialPlanWarning`` saying how much of the model was split,
            instead of a ``RecipeError``. Idle ranks are refused all the same.
        progress: Called with a line as each stage (tracing, the recipe, materializing, code
            generation) starts and ends, with its time: how a large model's planning shows progress.
        rank: The rank this process runs: only its module is generated now, every other rank's the first time
            ``plan.sources[r]`` is read (``codegen.sources``); None generates every rank's now.
        bucket_bytes: The size the gradient buckets are cut at (DDP's ``bucket_cap_mb``; None: 25 MiB). The buckets
            are part of the plan: the runtime sums them and the simulator prices them.
        measured_prices: Each op's measured seconds for a pipeline's ``balance="measured"``; None times the ops on the
            module's device when a recipe asks (``sim.profile.measured_prices``).
        **params: The recipe's parameters (checked against the catalog before anything runs).
    """
    from lightning_nnscaler.plans.catalog import apply_recipe
    from lightning_nnscaler.plans.coverage import check_coverage
    from lightning_nnscaler.plans.propagate import recording_refusals
    from lightning_nnscaler.sim.profile import measured_prices as timed_on

    stage = _Stages(progress)
    with stage(f"tracing {type(module).__name__}.{step or 'forward'}"):
        logged = replica_buffers = None
        if step is not None:  # the step's Python values that tracing would freeze: refused, or checked every step
            traced = trace_step(module, example_args, batch_idx, step=step, extra=step_args)
            graph, step_values = traced.graph, traced.step_values
            check_batch_rows(graph, recipe, world_size, params)  # before the replica's share is traced
            logged = _plan_logged_values(module, example_args, traced, recipe, world_size, params, batch_idx, step, step_args)
            replica_buffers = _replica_buffers(module, example_args, graph, recipe, world_size, params, batch_idx, step, step_args)
        else:
            graph, step_values = trace(module, example_args, step=step), StepValues()
            check_batch_rows(graph, recipe, world_size, params)
    planned = graph.copy()
    with stage(f"planning {len(graph.ops)} ops with recipe {recipe} for {world_size} ranks"):
        with recording_refusals() as refusals, collector_paused():  # refusals: ops the recipe meant to split but could not
            prices = measured_prices or timed_on(_device_of(module))
            context = apply_recipe(planned, recipe, world_size, measured_prices=prices, **params)
            model_parallel = world_size // context.layout.data_parallel if context.layout is not None else 1
            check_coverage(planned, graph, world_size, recipe=recipe, allow_partial=allow_partial, refusals=refusals, model_parallel=model_parallel)
    if context.pipeline is not None:
        warn_statistics_per_microbatch(graph)
    loaded_replicas = world_size if recipe == "auto" else world_size // model_parallel  # auto's loader gives every rank its own rows
    kept = kept_targets(graph, loaded_replicas) if loaded_replicas > 1 else None
    if kept is not None and kept.masks:
        example = bind_inputs(graph, module, example_args, step=step)
        warn_means_over_kept_targets(kept.per_replica({tensor.name: example[tensor.name] for tensor in graph.user_inputs}), loaded_replicas)
    modules = f"rank {rank}'s module" if rank is not None else f"{world_size} modules"
    with stage(f"materializing {len(planned.ops)} pieces and generating {modules}"):
        plan = build_plan(
            module, example_args, step, graph, planned, world_size, recipe=recipe, params=params, zero_stage=context.zero_stage,
            validated=True, communication_cost=communication_cost, layout=context.layout, pipeline=context.pipeline, rank=rank,
            bucket_bytes=bucket_bytes,
        )
    plan.step_values = step_values
    plan.logged = logged
    plan.returned = traced.returned if step is not None else "loss"
    plan.replica_buffers = replica_buffers
    plan.search = context.search
    plan.kept_targets = kept
    return plan


def check_batch_rows(graph: Graph, recipe: str, world_size: int, params: dict[str, Any]) -> None:
    """Raise unless the recipe's data-parallel replicas divide the batch, so each gets the same rows (at least one).

    Raises:
        RecipeError: a bad recipe or parameter (``RecipeSpec.layout``).
        ValueError: naming the batch input, its rows, the replicas and the fix.
    """
    from lightning_nnscaler.plans.catalog import load_recipe

    layout = load_recipe(recipe).layout(world_size, params)
    replicas = layout.data_parallel
    for tensor in graph.user_inputs:
        rows = tensor.shape[0] if tensor.shape else None
        if rows is not None and rows % replicas:
            few = f"fewer rows than its {replicas} replicas" if rows < replicas else f"rows that its {replicas} replicas do not divide"
            raise ValueError(
                f"recipe {recipe!r} on {world_size} ranks splits the batch over {replicas} data-parallel replicas ({layout.grid}), "
                f"but batch input %{tensor.name} has {rows} row{'s' * (rows != 1)}, {few}: some replica would get "
                f"{'no' if rows < replicas else 'fewer'} rows. Give a batch of a multiple of {replicas} rows (under the Trainer, "
                "the DataLoader's batch_size is per replica), or use fewer ranks or a recipe with fewer data-parallel replicas"
            )


def _device_of(module: nn.Module) -> str:
    """Where ``module``'s parameters are: ``cuda:<index>``, else ``cpu`` (also for a module on meta)."""
    device = next((parameter.device for parameter in module.parameters()), torch.device("cpu"))
    return str(device) if device.type == "cuda" else "cpu"


def _plan_logged_values(
    module: nn.Module, batch: Any, traced: TracedStep, recipe: str, world_size: int, params: dict[str, Any], batch_idx: int,
    step: str = "training_step", step_args: tuple = (),
) -> LoggedValues:
    """What the traced step logs, computed per data-parallel replica (``logged_values``); edits ``traced.graph``."""
    from lightning_nnscaler.plans.catalog import load_recipe

    replicas = load_recipe(recipe).layout(world_size, params).data_parallel
    replica_graph = None
    if replicas > 1 and (any(call.output is not None for call in traced.logs) or traced.metric_calls):
        replica_graph = trace_step(module, replica_rows(batch, replicas), batch_idx, step=step, extra=step_args).graph
    return plan_logged_values(traced.graph, traced.logs, replicas, replica_graph, traced.metric_calls)


def _replica_buffers(
    module: nn.Module, batch: Any, graph: Graph, recipe: str, world_size: int, params: dict[str, Any], batch_idx: int,
    step: str = "training_step", step_args: tuple = (),
) -> ReplicaBufferUpdates | None:
    """The step's arithmetic buffer updates, per replica (``replica_buffers``); a warning names those left to the plan."""
    from lightning_nnscaler.plans.catalog import load_recipe

    replicas = load_recipe(recipe).layout(world_size, params).data_parallel
    if replicas == 1 or not graph.buffer_updates:
        return None
    updates = replica_buffer_updates(graph, trace_step(module, replica_rows(batch, replicas), batch_idx, step=step, extra=step_args).graph)
    if updates is not None and updates.left_to_the_plan:
        warnings.warn(
            f"{type(module).__name__}.training_step updates the buffers {updates.left_to_the_plan} from parameters: the plan "
            f"updates them over the global batch ({replicas} replicas' rows), where each ddp rank updates its own copy from "
            "its own rows", stacklevel=3,
        )
    return updates


def replica_rows(batch: Any, replicas: int) -> Any:
    """The first data-parallel replica's share of a whole ``batch``: the first ``1/replicas`` of dim 0 of each tensor."""
    return pytree.tree_map(lambda leaf: leaf[: leaf.shape[0] // replicas] if isinstance(leaf, torch.Tensor) and leaf.dim() else leaf, batch)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused: planning allocates millions of small acyclic IR objects (pieces,
    masks, actions), and each full collection rescans all of them; paused, hybrid3d's recipe for GPT-2 on 128 ranks
    takes 3.1 s of CPU instead of 5.5 s. Restores the collector's previous state."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class _Stages:
    """``with stage("tracing ..."):`` reports the start and the end (with seconds) of each planning stage."""

    def __init__(self, progress: Callable[[str], None] | None) -> None:
        self.progress = progress

    @contextlib.contextmanager
    def __call__(self, what: str) -> Iterator[None]:
        if self.progress is None:
            yield
            return
        self.progress(f"{what} ...")
        start = time.perf_counter()
        yield
        self.progress(f"{what}: done in {time.perf_counter() - start:.1f} s")


def warn_statistics_per_microbatch(graph: Graph) -> None:
    """Warn that a pipeline's BatchNorm takes statistics per microbatch (as ``torch.distributed.pipelining`` does)."""
    from lightning_nnscaler.ir.rules.batch_norm import per_piece_statistics

    modules = sorted({
        graph.tensors[piece.name].state_key.rsplit(".", 1)[0] for op in graph.ops if per_piece_statistics(op)
        for piece in op.tensor_inputs if graph.tensors[piece.name].role == "buffer"
    })
    if modules:
        warnings.warn(
            f"BatchNorm {', '.join(modules)}: under a pipeline each microbatch is normalized with its own statistics "
            "(as torch.distributed.pipelining does), not the replica's batch as under ddp", UserWarning, stacklevel=3,
        )


class GlobalMeanWarning(UserWarning):
    """A loss averages over a count that depends on the batch's values (targets a cross-entropy keeps, not
    its ``ignore_index``), and the data-parallel replicas keep different counts: the plan takes the whole
    global batch's mean, as one device does, where ddp averages each replica's own mean."""


def warn_means_over_kept_targets(counts: dict[str, list[int] | None], replicas: int, *, stacklevel: int = 3) -> None:
    """Warn (``GlobalMeanWarning``) naming the losses whose replicas keep different numbers of targets, or whose
    counts could not be told apart by replica (None); ``counts`` holds each replica's count per loss
    (``KeptTargets.per_replica``). Where every replica keeps as many, ddp's average of the replicas' means is
    the global mean, and nothing is said."""
    differing = {loss: each for loss, each in counts.items() if each is None or len(set(each)) > 1}
    if not differing:
        return
    kept = "; ".join(f"{loss} keeps {min(each)} to {max(each)} targets per replica" for loss, each in differing.items() if each is not None)
    warnings.warn(
        f"{', '.join(differing)}: the mean over the targets kept (not ignore_index) is taken over the whole global batch of "
        f"{replicas} data-parallel replicas, as one device takes it; ddp averages each replica's own mean, and the "
        f"replicas keep different numbers of targets{f' ({kept})' if kept else ' (or they cannot be counted per replica)'}, so the "
        "gradients differ from ddp's (they equal a single device's on the global batch). The plan computes every sum over the "
        "batch globally, so a per-replica mean cannot be asked for; to silence this, filter lightning_nnscaler.GlobalMeanWarning.",
        GlobalMeanWarning, stacklevel=stacklevel,
    )


def build_plan(
    module: nn.Module, example_args: Any, step: str | None, graph: Graph, planned: Graph, world_size: int,
    *, recipe: str = "custom", params: dict[str, Any] | None = None, zero_stage: int = 0, validated: bool = False,
    communication_cost: Any = None, layout: RecipeLayout | None = None, pipeline: PipelinePlan | None = None, rank: int | None = None,
    bucket_bytes: int | None = None,
) -> Plan:
    """Materialize a graph planned by any means (a recipe or hand-written primitives) and generate code.

    ``validated=True`` when ``planned`` was just checked by ``validate_plan`` (``apply_recipe`` does).
    ``layout`` is the recipe's promise of data-parallel replicas (default: one replica, every rank
    loads the whole batch); each rank's batch pieces must lie inside its replica's rows.
    ``pipeline`` is the schedule of a plan whose ops carry segments (``PlanContext.pipeline``).
    ``rank``: materialize, lower and generate only that rank's module now (a pipelined plan's rank-local materialization,
    ``materialize(rank=)``, checking that rank's message channels); every rank's, and the others' modules, when first asked
    for (``parallelize``'s ``rank``).
    ``bucket_bytes``: the size the gradient buckets are cut at (None: ``program.BUCKET_BYTES``, DDP's 25 MiB).

    Raises:
        PlanError: a rank reads batch rows outside its replica's share (the layout does not match the plan).
    """
    params = dict(params or {})
    shared_stages = frozenset(stage for stage in range(pipeline.schedule.stages) if pipeline.schedule.is_shared(stage)) if pipeline else frozenset()
    lists = [pipeline.actions(each) for each in range(world_size)] if pipeline else None
    dtypes = {tensor.name: tensor.dtype for tensor in graph.parameters}

    def lowered(local: int | None, validate_first: bool) -> tuple[Program, StepProgram]:
        """Materialize (rank ``local``'s program alone, or every rank's) and lower; check the message order."""
        program = materialize(planned, world_size, validate=validate_first, cost=communication_cost, shared_stages=shared_stages, rank=local)
        if program.pipelined and pipeline is None:
            raise PlanError("the plan's ops carry pipeline segments but no schedule orders them: pass pipeline= (a PipelinePlan)")
        check_batch_split(program, graph, layout or single_replica(world_size, {}), recipe)
        steps = step_program(program, lists, dtypes, zero_stage=zero_stage, bucket_bytes=bucket_bytes or BUCKET_BYTES)
        if pipeline is not None:
            check_pipeline(program, steps, pipeline)
        return program, steps

    with collector_paused():
        program, steps = lowered(rank, not validated)
        schedules = [[str(action) for action in each] for each in lists] if lists else None
        plan_hash = digest("\n".join([CODEGEN_VERSION, str(world_size), str(zero_stage), str(steps.bucket_bytes), str(graph), str(planned), str(schedules)]))
        label = f"recipe {recipe}" + (f" {params}" if params else "")
        whole = (lambda: _paused(lowered, None, False)) if program.local_rank is not None else None
        sources = RankSources(Lowered(program, steps, whole), plan_hash[:12], label)
        sources.generate(range(world_size) if rank is None else (rank,))
    return Plan(
        module, example_args, step, recipe, params, world_size, graph, planned, sources.lowered, sources, plan_hash, zero_stage, layout,
        pipeline=pipeline,
    )


def _paused(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` with the cyclic garbage collector paused (``collector_paused``)."""
    with collector_paused():
        return function(*args)


def check_pipeline(program: Program, steps: StepProgram, pipeline: PipelinePlan) -> None:
    """Raise before any process starts unless ``pipeline`` can run ``program`` as the step's ``steps`` order it.

    The schedule must validate (``schedules.validate`` of its lowering: every dependency respected,
    messages paired in order, no cross-rank cycle; a ``ScheduleError`` shows the step × rank grid), every
    message the program posts must pair in order (``materialize.steps.check_message_order``), and each
    rank's schedule must run exactly the segments its program has.

    Raises:
        ScheduleError: the schedule would hang or run an action before its dependency.
        PlanError: a rank's schedule and its segments differ.
    """
    validate(lower(pipeline.schedule))
    check_message_order(program, steps)
    if len(pipeline.column_of_rank) != program.world_size:
        raise PlanError(f"the pipeline places {len(pipeline.column_of_rank)} ranks, but the plan has {program.world_size}")
    for rank_program in program.ranks:
        scheduled = {(action.stage, action.microbatch) for action in pipeline.actions(rank_program.rank)}
        present = {action.segment for action in rank_program.actions if isinstance(action, Compute)} - {PROLOGUE}
        if present - scheduled:
            raise PlanError(
                f"rank {rank_program.rank} runs segments {sorted(present - scheduled)[:4]} (stage, microbatch) that its schedule "
                f"never runs; its schedule: {[str(action) for action in pipeline.actions(rank_program.rank)][:12]}"
            )


def check_batch_split(program: Program, graph: Graph, layout: RecipeLayout, recipe: str) -> None:
    """Raise unless every rank's batch pieces lie in the rows its data-parallel replica loads.

    With ``layout.data_parallel`` replicas, replica ``i`` loads rows ``[i * n, (i + 1) * n)`` of each
    batch input (``n`` = batch / replicas): a rank that read other rows would need samples its
    DataLoader never loaded.
    """
    replicas = layout.data_parallel
    for tensor in graph.user_inputs:
        if tensor.shape and tensor.shape[0] % replicas:
            raise PlanError(
                f"recipe {recipe!r}: batch input %{tensor.name} has {tensor.shape[0]} rows, which its {replicas} "
                f"data-parallel replicas ({layout.grid}) do not divide"
            )
    rows = {tensor.name: tensor.shape[0] // replicas for tensor in graph.user_inputs if tensor.shape}
    for rank_program in program.ranks:
        replica = layout.replica(rank_program.rank)
        for local in rank_program.inputs:
            if local.role != "input" or local.name not in rows:
                continue
            start, stop = local.box[0]
            first, last = replica * rows[local.name], (replica + 1) * rows[local.name]
            if start < first or stop > last:
                raise PlanError(
                    f"recipe {recipe!r}: rank {rank_program.rank} reads rows [{start}, {stop}) of batch input %{local.name}, "
                    f"but its data-parallel replica {replica} of {replicas} ({layout.grid}) loads rows [{first}, {last}). "
                    "The recipe's layout must declare the data-parallel axis its plan splits the batch over."
                )
