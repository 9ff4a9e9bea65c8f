"""Plan search for a hypothetical cluster ("plan for 32 A100s from a laptop"): dp × tp × pp 1F1B plans of a
transformer given by its shape (``sim.analytic``), simulated on a spec file's cluster; no graph is traced and
no process started, so paper-scale models search in seconds. A symmetric plan simulates one rank per stage
(``sim.symmetric``): 16,384 GPUs in well under a second.

Memory per rank: mixed-precision Adam keeps 16 bytes per parameter it holds (bf16 weights and gradients, fp32
master weights and two moments; Rajbhandari et al. 2020, §3.1), plus the simulated peak of kept activations
and the copies of the messages the rank has sent (the runtime holds them until the step's end, ``sim.tasks``).
Under ZeRO-1 the 12 bytes of fp32 state per parameter are divided by dp. A plan also says its activation
recompute and sequence parallelism (``analytic.Recipe``); ``search_cluster`` tries each, so under a memory limit
it picks recompute or ZeRO-1 where the plain plan does not fit; it also tries interleaved virtual stages
(``virtual_stages``) and, when asked, overlaps the gradient reduction with the last backward.

A spec named by its name or path is priced with its large-run terms (``sim.large_run``: efficiencies fitted to
published throughput of large training runs); each ``ClusterOutcome`` states what it assumed in ``basis``: the
spec and the terms it priced with, the recipe, and the calibration error of those terms.
The reference models' paper configurations map to shapes by ``paper_shapes`` (approximations stated there).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from lightning_nnscaler.explain import human_bytes
from lightning_nnscaler.sim.analytic import OPTIMIZER_STATE_BYTES, RECOMPUTE_MODES, Recipe, TransformerShape, transformer_task_lists
from lightning_nnscaler.sim.results import Machine, SimResult
from lightning_nnscaler.sim.costs import CommModel
from lightning_nnscaler.sim.large_run import cluster_spec, large_run_terms
from lightning_nnscaler.sim.search import divisors, memory_limit
from lightning_nnscaler.sim.simulate import simulate
from lightning_nnscaler.sim.specs import HardwareSpec
from lightning_nnscaler.sim.symmetric import SymmetricComm, expand, representative_ranks, symmetric_layout

BYTES_PER_PARAMETER = 16  # bf16 weight + bf16 gradient + fp32 master weight, momentum, variance
MICROBATCH_SIZES = (1, 2, 4)


@dataclass(frozen=True, kw_only=True)
class ClusterPlan(Recipe):
    """A dp × tp × pp 1F1B plan (rank = (replica · pp + stage) · tp + piece, as ``hybrid3d``) at ``microbatch_size``
    sequences per microbatch, trained as its ``analytic.Recipe`` fields say (activation ``recompute``, ``zero1``,
    ``sequence_parallel``, ``virtual_stages``, ``overlap_grad_reduce``, ``overlap_tp_comm``; the defaults: none of
    them); it is passed as the recipe itself."""

    dp: int
    tp: int
    pp: int
    microbatch_size: int

    def __str__(self) -> str:
        extras = ([f"{self.recompute} recompute"] * (self.recompute != "none") + ["ZeRO-1"] * self.zero1 + ["sp"] * self.sequence_parallel
                  + [f"interleaved × {self.virtual_stages}"] * (self.virtual_stages > 1)
                  + ["overlapped grad reduce"] * self.overlap_grad_reduce + ["overlapped tp comm"] * self.overlap_tp_comm)
        return f"dp {self.dp} × tp {self.tp} × pp {self.pp}, microbatch {self.microbatch_size}" + "".join(f", {extra}" for extra in extras)


def state_bytes(shape: TransformerShape, plan: ClusterPlan, stage: int) -> float:
    """Bytes of weights, gradients and optimizer state on one rank of ``stage``: ``BYTES_PER_PARAMETER`` per
    parameter it holds (÷ tp), the fp32 part (``optimizer_state_bytes``) ÷ dp under ZeRO-1."""
    if not plan.zero1:
        return BYTES_PER_PARAMETER * shape.stage_parameters(stage, plan.pp) / plan.tp
    return (BYTES_PER_PARAMETER - OPTIMIZER_STATE_BYTES) * shape.stage_parameters(stage, plan.pp) / plan.tp + optimizer_state_bytes(shape, plan, stage)


def optimizer_state_bytes(shape: TransformerShape, plan: ClusterPlan, stage: int) -> float:
    """fp32 master weights and Adam moments on one rank of ``stage``: 12 bytes per parameter it holds, ÷ dp under ZeRO-1."""
    return OPTIMIZER_STATE_BYTES * shape.stage_parameters(stage, plan.pp) / (plan.tp * (plan.dp if plan.zero1 else 1))


@dataclass
class ClusterOutcome:
    """A plan's simulated step and fullest rank, or why it does not fit."""

    plan: ClusterPlan
    step_seconds: float
    peak_bytes: float
    reason: str = ""
    basis: str = ""
    """What the prediction assumed: the spec and terms it priced with, the recipe, the calibration error."""


def prediction_basis(spec: HardwareSpec, plan: ClusterPlan) -> str:
    """What a prediction of ``plan`` on ``spec`` assumes, in a line: the spec and the terms it prices with, the
    overlap it counts on, and (with large-run terms) their calibration error on published runs."""
    terms = large_run_terms(spec)
    traffic, held = getattr(spec, "activation_traffic", 0.0), getattr(spec, "message_overhead_s", 0.0)
    priced = (f"{spec.name}: matmuls at {spec.matmul_efficiency:.3f} of peak, {spec.op_overhead_s * 1e6:.1f} µs per kernel, "
              + (f"{traffic:.2f} passes over a block's activations at {spec.memory_efficiency:.2f} of memory bandwidth, " * bool(traffic))
              + (f"{held * 1e3:.2f} ms held per stage message, " * bool(held))
              + f"inter-node {spec.inter_node.bandwidth / 1e9:.1f} GB/s, intra-node {spec.intra_node.bandwidth / 1e9:.0f} GB/s")
    grads = "gradient reduction overlapped with the last backward" if plan.overlap_grad_reduce else "gradient reduction after the flush"
    tensor = "tp collectives hidden behind the matmuls" if plan.overlap_tp_comm else "tp collectives after the matmuls"
    overlap = f"{grads}; {tensor}; stage messages not overlapped"
    error = (terms.calibration if terms is not None and spec.name.endswith(" (large-run terms)")
             else "not calibrated on published large runs")
    return f"{priced}; {overlap}; {error}"


def paper_shapes(global_batch: int = 128) -> dict[str, TransformerShape]:
    """The reference models' paper configurations as transformer shapes, ``global_batch`` samples per step:

    - GPT-3 6.7B (``GPTConfig.paper()``): 32 blocks, hidden 4096, 2048 tokens, vocab 50257, 32 heads.
    - mBART-large (``MBartConfig.paper()``): its 12 encoder and 12 decoder blocks as 24 blocks of hidden 1024
      over 1024 tokens (the decoder's cross-attention, a third of a decoder block's FLOPs, not counted), vocab
      250027 with an untied head, 16 heads.
    - Swin (``SwinConfig.paper()``): its 48 blocks as 48 blocks of the third stage's shape (hidden 2048, 14²
      = 196 tokens): each patch merging quarters the tokens and doubles the width, so every block has the same
      matmul FLOPs; earlier stages' activations (up to 4× larger) and the windowed attention are approximated.
    """
    common = {"global_batch": global_batch, "embeddings": True}
    return {
        "GPT-3 6.7B": TransformerShape(layers=32, hidden=4096, seq_len=2048, vocab=50257, heads=32, **common),
        "mBART-large (vocab 250k)": TransformerShape(layers=24, hidden=1024, seq_len=1024, vocab=250027, heads=16, **common),
        "Swin (48 blocks, width 512-4096)": TransformerShape(layers=48, hidden=2048, seq_len=196, vocab=1000, heads=64, **common),
    }


def simulate_plan(shape: TransformerShape, spec: HardwareSpec, plan: ClusterPlan, *, symmetric: bool | None = None) -> SimResult:
    """One step of ``plan`` of ``shape`` (at the plan's microbatch size) on ``spec``, every rank's stats.

    ``symmetric``: simulate one representative rank per stage and let it stand for its replicas and tp peers
    (``sim.symmetric``: ``pp`` task lists, the same result); None (the default) does so whenever the plan's
    layout on ``spec``'s nodes is symmetric (``symmetric_layout``), False simulates rank by rank (for checking).

    Raises:
        ValueError: ``symmetric=True`` for a layout whose ranks of a stage meet different links.
    """
    sized = replace(shape, microbatch_size=plan.microbatch_size)
    layout = {"dp": plan.dp, "tp": plan.tp, "pp": plan.pp}
    comm = CommModel(spec)
    if symmetric is not False:
        if symmetric_layout(spec.ranks_per_node, **layout, wrap=plan.virtual_stages > 1):
            lists = transformer_task_lists(sized, spec, **layout, representatives=True, recipe=plan)
            result = simulate(lists, SymmetricComm(comm, representative_ranks(tp=plan.tp, pp=plan.pp)), Machine(spec.ranks_per_node))
            return expand(result, **layout)
        if symmetric:
            raise ValueError(f"{plan} is not symmetric on {spec.ranks_per_node} ranks per node: simulate it rank by rank")
    return simulate(transformer_task_lists(sized, spec, **layout, recipe=plan), comm, Machine(spec.ranks_per_node))


def evaluate(shape: TransformerShape, spec: HardwareSpec, plan: ClusterPlan, limit: float, *, symmetric: bool | None = None) -> ClusterOutcome:
    """Simulate ``plan`` of ``shape`` on ``spec`` (``simulate_plan``); over ``limit`` bytes on some rank is a reason."""
    result = simulate_plan(shape, spec, plan, symmetric=symmetric)
    states = [state_bytes(shape, plan, stage) for stage in range(plan.pp)]
    peaks = [states[rank // plan.tp % plan.pp] + stats.peak_live_bytes for rank, stats in enumerate(result.ranks)]
    peak = max(peaks)
    reason = f"peak {human_bytes(peak)} is over the {human_bytes(limit)} limit" if peak > limit else ""
    return ClusterOutcome(plan, result.step_seconds, peak, reason, prediction_basis(spec, plan))


def cluster_plans(
    shape: TransformerShape, world_size: int, ranks_per_node: int, *, recipes: bool = True,
    virtual_stages: Sequence[int] = (1,), overlap_grad_reduce: bool = False, prune: bool = False,
) -> list[ClusterPlan]:
    """dp × tp × pp over ``world_size`` ranks: tp divides the heads and stays in a node, pp divides the blocks,
    dp and the microbatch size divide the batch; ``recipes``: each also with every activation recompute, with
    and without ZeRO-1 (dp > 1) and sequence parallelism (tp > 1); each pipeline (pp > 1) also interleaved with
    each of ``virtual_stages`` chunks per rank that divides its blocks (its microbatches a multiple of pp, as
    Megatron requires); all with ``overlap_grad_reduce``. ``prune``: without the recipes the model finds never
    faster nor smaller (ZeRO-1 off where dp > 1, sp off where tp > 1: the same ring bytes, more memory)."""
    found = []
    for tp in [value for value in divisors(world_size) if value <= ranks_per_node and shape.heads % value == 0]:
        for pp in [value for value in divisors(world_size // tp) if shape.layers % value == 0]:
            dp = world_size // (tp * pp)
            for size in MICROBATCH_SIZES:
                if shape.global_batch % (dp * size) == 0:
                    microbatches = shape.global_batch // (dp * size)
                    chunks = [v for v in virtual_stages if v == 1 or (pp > 1 and shape.layers % (pp * v) == 0 and microbatches % pp == 0)]
                    found += [ClusterPlan(dp=dp, tp=tp, pp=pp, microbatch_size=size, recompute=recompute, zero1=zero1,
                                          sequence_parallel=sp, virtual_stages=v, overlap_grad_reduce=overlap_grad_reduce)
                              for v in chunks
                              for recompute in (RECOMPUTE_MODES if recipes else ("none",))
                              for zero1 in (((True,) if prune else (False, True)) if recipes and dp > 1 else (False,))
                              for sp in (((True,) if prune else (False, True)) if recipes and tp > 1 else (False,))]
    return found


def search_cluster(
    shape: TransformerShape, spec: HardwareSpec | str, world_size: int, *, memory_limit_gb: float | None = None,
    recipes: bool = True, virtual_stages: Sequence[int] = (1,), overlap_grad_reduce: bool = False, prune: bool = False,
) -> tuple[list[ClusterOutcome], float]:
    """Every ``cluster_plans`` candidate simulated (``recipes``: with each recompute, ZeRO-1 and sequence
    parallelism too; each of ``virtual_stages``; ``overlap_grad_reduce``): those that fit fastest first, then the
    others; and the seconds taken. A spec given by name or path is priced with its large-run terms
    (``large_run.cluster_spec``); a ``HardwareSpec`` as it is. ``prune``: leave out the dominated recipes
    (``cluster_plans``) and, per layout, the recomputes after the first that fits (each recomputes more: slower)."""
    start = time.perf_counter()
    hardware = cluster_spec(spec)
    limit = memory_limit(hardware, memory_limit_gb)
    plans = cluster_plans(shape, world_size, hardware.ranks_per_node, recipes=recipes, virtual_stages=virtual_stages,
                          overlap_grad_reduce=overlap_grad_reduce, prune=prune)
    outcomes, settled = [], set()
    for plan in plans:
        layout = replace(plan, recompute="none")
        if layout in settled:
            continue
        outcomes.append(evaluate(shape, hardware, plan, limit))
        if prune and not outcomes[-1].reason:
            settled.add(layout)
    outcomes.sort(key=lambda outcome: (bool(outcome.reason), outcome.step_seconds))
    return outcomes, time.perf_counter() - start


def megatron_baseline(shape: TransformerShape, spec: HardwareSpec | str, world_size: int, *, tp: int = 8, pp: int = 4) -> ClusterOutcome:
    """The Megatron-style plan: ``tp`` within a node × ``pp`` stages (dp the rest), microbatch 1, whatever its memory
    (priced as ``search_cluster`` prices)."""
    return evaluate(shape, cluster_spec(spec), ClusterPlan(dp=world_size // (tp * pp), tp=tp, pp=pp, microbatch_size=1), float("inf"))
