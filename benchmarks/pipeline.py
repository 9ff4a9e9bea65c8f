"""Pipeline schedules on 4 real gloo CPU ranks: step time, measured bubble, activation peaks, and
torch.distributed.pipelining on the same stages (issue 8's acceptance).

For each schedule (GPipe, 1F1B, interleaved 1F1B with v=2, ZB-H1, and the V shapes ZB-V, V-Half and DualPipeV,
whose rank r holds stages r and 2p-1-r) and m microbatches of a GPT:

1. *ours*: the plan from ``lnn.parallelize(..., stages=p, microbatches=m)`` run by ``RankExecutor``
   on spawned processes (torch.distributed over gloo, every wait bounded by a timeout); warm-up
   steps, then timed ``forward_backward`` steps (barrier before and after each). Two measured
   bubbles, compute being the time inside F/B/W actions less the time those actions spent blocked
   in ``recv`` or a collective (waiting for a peer is bubble): *bubble (step)*, a rank's
   ``1 - compute / step wall time`` averaged over ranks and steps (everything outside the actions
   counts as idle), and *bubble (schedule)*, ``1 - sum of compute / (ranks × span of the actions)``
   (``schedule_bubble``: the textbook's quantity). They are printed next to the textbook value:
   (p-1)/(m+p-1), interleaved (p-1)/(v m+p-1), and for ZB-H1, ZB-V, V-Half and DualPipeV the symbolic
   execution of our schedule with F = B = W (``schedules.bubble_fraction``; ZB-H1 about a third of 1F1B's).
2. Peak activation bytes per rank: bytes of distinct storages saved for backward
   (``torch.autograd.graph.saved_tensors_hooks``, parameters excluded) alive at once during one
   step, in units of one microbatch's worth of the rank's stage(s) (everything the rank saves in a
   step / m), with the schedule's expected in-flight count in brackets (1F1B: p-r, GPipe: m; with two
   stages per rank, interleaved and the V shapes, ``peak_in_flight`` / 2: a stage is half a rank's share).
3. *torch*: ``torch.distributed.pipelining`` on the same model cut by hand where the plan cut it, at
   sub-layer granularity: each parameter's stage is the one whose segments read it in the planned graph,
   checked against the rank that holds it (rank r holds stages r, r+p looped, or r and 2p-1-r in a V,
   where the two stages of rank p-1 are adjacent and holding alone cannot place the cut between them)
   (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B with 2 stages per rank,
   ScheduleInterleavedZeroBubble with 1 stage per rank for ZB-H1, ScheduleZBVZeroBubble and
   ScheduleDualPipeV with 2 stages per rank in the V; torch ships no V-Half: n/a), same microbatches,
   same ranks, same warm-up and timed steps; ours / torch is the ratio (goal <= 1.0). DualPipeV (ours
   and torch's) needs m >= 2p; torch's runs its overlapped F+B pairs one after the other (no callbacks).
   Known peer limit (torch 2.13, gloo CPU): ScheduleInterleavedZeroBubble's weight backward raises
   "Trying to use a saved tensor that has been detached in-place" when a stage receives two tensors
   (a cut between a layer norm and its attention); the row then reads n/a with torch's error.

A second table (issue 9's acceptance) pipelines a recycling model, the Evoformer reference with
``recycles=3`` (two passes under ``torch.no_grad()``, then one with gradients): 3F1B
(``lnn.parallelize(..., "3f1b", ...)``) against GPipe with the recycling passes run outside the
pipeline. The baseline is the same planned graph and stage cut with a hand-built schedule
(``recycling_outside_schedule``): each rank runs every recycling pass's stage as a forward pipeline
over all microbatches (pass 0, then pass 1), then GPipe on the gradient pass (all F, then all B in
microbatch order); only the generated SCHEDULE differs. A third row runs nnScaler's own 3F1B order
(``schedules.interleaved_recycling``: interleaved 1F1B with the recycling backwards left out) on the same
stages. Columns: ms/step, speed-up over the baseline (goal >= 1.2), measured bubble, and the symbolic
``bubble_fraction`` of each schedule (F = 1, B = 2, a no-grad forward costs as much as a forward).

With fewer cores than ranks (the default machine: 4 ranks on 2 cores) ranks slow each other down
while they compute at once, which makes measured bubbles smaller than on dedicated cores.

A third table (issue 9's acceptance) pipelines a large-vocabulary model, the mBART-style reference
with a 32000-token vocabulary: the interlaced pipeline (``"interlaced"``: the embedding lookups and
the output projection split by vocabulary over all 4 ranks, run by every rank between its 1F1B
actions) against 1F1B, whose stage cut puts the whole projection and loss on the last rank.

Run: python benchmarks/pipeline.py                    (all three tables; about 10 minutes on 2 cores)
     python benchmarks/pipeline.py --only gpt         (the GPT table alone: about 5 minutes on 2 cores, 3 on 4 free ones)
     python benchmarks/pipeline.py --only recycling   (the 3F1B table alone)
     python benchmarks/pipeline.py --only vocabulary  (the interlaced table alone)
     python benchmarks/pipeline.py --quick            (smaller models and fewer steps)
     python benchmarks/pipeline.py --only gpt --schedules 1f1b,zb1 [--ranks 2]
                                                      (some schedules of the GPT table; p ranks)
     python benchmarks/pipeline.py --only gpt --schedules 1f1b,zbv,vhalf,dualpipev
                                                      (issue 38's rows and comparisons)
     python benchmarks/pipeline.py --only gpt --rounds 2  (fewer rounds of the GPT table: each ~1/3 of its time)
     benchmarks/lent_machine.sh [CORES] [ROUNDS]      (GPT and 3F1B tables pinned to CORES, default 0-3)
     python benchmarks/pipeline.py --only split       (one rank: F+B against F+I+W, ours, torch's, the old re-walk)
     python benchmarks/pipeline.py --only split --hidden 512 --rows 8   (the same with larger ops)

The GPT table's "compute ms/step by rank" is each rank's time inside its actions less its waits; with
both 1f1b and zb1 run, a line compares them (F+I+W against F+B per rank, and the step). With more
ranks than cores the ranks' compute slows whenever more of them run at once, which a smaller bubble
causes: zb1's rank 0 runs exactly 1F1B's work (it has no I) and still reads slower there. ``--only
split`` measures the split's own cost without peers or contention.

With 1f1b run, lines below the table give issue 38's comparisons, from the table's own numbers: ZB-V's
throughput / 1F1B's (1f1b ms / zbv ms, goal >= 1.15) and ZB-V's activation peak / 1F1B's (goal <= 1.0),
V-Half's activation peak / 1F1B's (goal <= 0.6), peaks in bytes (the max over ranks of the metered
step's peak), and 1F1B's measured bubble (schedule) less the textbook's, in points (goal <= 5).

Every rank, and ``--only split``'s process, keeps the memory it frees for its next tensors (``cache_freed_memory``:
glibc's malloc tuned as a GPU's caching allocator behaves), ours and torch's alike; ``--glibc-default`` leaves
glibc's defaults, under which a schedule that holds more tensors pays for mapping their pages again.

Each rank runs with ``torch.set_num_threads(1)``, so p ranks use p cores: on a larger machine the run
can share it with another job pinned elsewhere (``taskset -c 0-3 python benchmarks/pipeline.py ...``).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import math
import re
import resource
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lightning_nnscaler as lnn
from lightning_nnscaler.codegen import module_from_source
from lightning_nnscaler.launch import LaunchError, launch
from lightning_nnscaler.models.evoformer import Evoformer, EvoformerConfig
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.models.mbart import MBart, MBartConfig
from lightning_nnscaler.plan import build_plan
from lightning_nnscaler.plans.context import PipelinePlan
from lightning_nnscaler.runtime import TorchDistributedCommunicator
from lightning_nnscaler.runtime.executor import RankExecutor
from lightning_nnscaler.schedules import (
    Action, Kind, Schedule, bubble_fraction, dual_pipe_v, execute, gpipe, interleaved, interleaved_recycling, lower, one_f_one_b,
    peak_in_flight, theoretical_bubble_fraction, v_half, validate, zb1, zbv,
)

SCHEDULES: dict[str, dict[str, int]] = {
    "gpipe": {}, "1f1b": {}, "interleaved": {"virtual_stages": 2}, "zb1": {}, "zbv": {}, "vhalf": {}, "dualpipev": {},
}
"""Our recipe names and their extra parameters."""
V_SHAPES = ("zbv", "vhalf", "dualpipev")
"""The schedules with two stages per rank in a V: rank r holds stages r and 2p-1-r."""
TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B", "zb1": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV",
}
"""torch.distributed.pipelining's schedule for each of ours (V-Half has none)."""
SUBLAYERS = ("ln_1", "attn", "ln_2", "mlp")
"""A GPT block's parameterized sub-layers in order: the units a pipeline stage cut may fall between."""


@dataclass(frozen=True)
class Measurement:
    """What every table measures alike: the pipeline's ranks and microbatches, the steps, the timeouts."""

    batch: int = 8
    stages: int = 4
    microbatches: int = 8
    warmup: int = 2
    steps: int = 5
    collective_timeout: float = 60.0
    run_timeout: float = 420.0
    caching_malloc: bool = True
    """Whether each rank keeps the memory it frees (``cache_freed_memory``; ``--glibc-default``: not)."""


@dataclass(frozen=True)
class Settings(Measurement):
    """The model, the pipeline and the measurement."""

    hidden: int = 256
    layers: int = 8
    heads: int = 4
    seq_len: int = 64
    vocab: int = 512
    batch: int = 16
    rounds: int = 3
    schedules: tuple[str, ...] = tuple(SCHEDULES)
    """The schedules of ``SCHEDULES`` to run (``--schedules``)."""
    activation_limit: str = "stages"
    """What ZB-V's and V-Half's memory limit counts (``--activation-limit``): stages alike, or each stage's saved bytes."""
    balance: str = "estimate"
    """What prices our stage cut (``--balance``): ``estimate`` from shapes, or ``measured`` op times; torch's stages are cut
    where ours are."""
    torch_peers: bool = True
    """Whether torch's schedule runs after each of ours (``--without-torch``: ours alone, where a peer's failure on some
    ranks would break the process group for the rows after it)."""

    def gpt_config(self) -> GPTConfig:
        """The GPT's shape."""
        return GPTConfig(vocab_size=self.vocab, seq_len=self.seq_len, hidden=self.hidden, layers=self.layers, heads=self.heads)

    def model(self) -> GPT:
        """A fresh GPT (weights from the caller's RNG state)."""
        return GPT(self.gpt_config())


@dataclass(frozen=True)
class RecyclingSettings(Measurement):
    """The recycling model, the pipeline and the measurement.

    The Evoformer is pair-heavy (a long crop, few MSA rows): its triangle updates, O(n_res³ c_z),
    dominate the work, and the MSA representation crossing a block boundary is small next to the
    pair one, so the planner's stage cut (which prefers cuts where few bytes cross) can fall between
    blocks and comes out balanced (op-cost shares 0.083 per stage). With many MSA rows only the
    pass boundaries are light places and one rank gets most of the work, whatever the schedule.
    """

    n_seq: int = 4
    n_res: int = 48
    c_m: int = 16
    c_z: int = 32
    blocks: int = 4
    recycles: int = 3
    batch: int = 8

    def evoformer_config(self) -> EvoformerConfig:
        """The Evoformer's shape: ``EvoformerConfig.small()`` scaled up, with ``recycles`` passes."""
        return dataclasses.replace(
            EvoformerConfig.small(), n_seq=self.n_seq, n_res=self.n_res, c_m=self.c_m, c_z=self.c_z, c_opm=8,
            msa_heads=4, pair_heads=4, blocks=self.blocks, recycles=self.recycles, distogram_bins=16,
        )

    def model(self) -> Evoformer:
        """A fresh Evoformer (weights from the caller's RNG state)."""
        return Evoformer(self.evoformer_config())


@dataclass(frozen=True)
class VocabularySettings(Measurement):
    """The large-vocabulary model (mBART-style encoder-decoder), the pipeline and the measurement.

    The vocabulary dominates as in mBART (250k tokens, 1024 wide): its embedding and output projection
    hold most parameters and the projection most of the work, so a 1F1B stage cut leaves the last
    stage (the projection and the loss) far heavier than the others.
    """

    vocab: int = 32000
    hidden: int = 128
    heads: int = 4
    encoder_layers: int = 2
    decoder_layers: int = 2
    seq_len: int = 32
    batch: int = 8

    def mbart_config(self) -> MBartConfig:
        """The mBART-style model's shape."""
        return MBartConfig(
            vocab_size=self.vocab, seq_len=self.seq_len, hidden=self.hidden, encoder_layers=self.encoder_layers,
            decoder_layers=self.decoder_layers, heads=self.heads,
        )

    def model(self) -> MBart:
        """A fresh mBART-style model (weights from the caller's RNG state)."""
        return MBart(self.mbart_config())


AnySettings = Settings | RecyclingSettings | VocabularySettings


@dataclass
class PlanPayload:
    """What a rank needs of a plan made in the parent: its code, constants and input names."""

    name: str
    virtual_stages: int
    sources: list[str]
    constants: dict[str, torch.Tensor]
    input_names: list[str]
    offsets: list[dict[str, int]]
    chunk_blocks: list[list[int]] = field(default_factory=list)
    """Sub-layers of each pipeline stage (chunk), read from the stages the plan reads each parameter in (``chunk_blocks``)."""
    stage_ranks: tuple[int, ...] = ()
    """Each pipeline stage's rank (the plan's ``schedule.stage_ranks``: r, r+p, … looped; r and 2p-1-r in a V)."""


# --- model and plans (parent) -----------------------------------------------------------------------


def build_model(settings: AnySettings) -> Any:
    """The settings' model (GPT or Evoformer) with seed-0 weights (the same on every process)."""
    torch.manual_seed(0)
    model = settings.model()
    model.log = lambda *args, **kwargs: None
    return model


def example_batch(model: Any, settings: AnySettings) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch every step uses: (tokens, targets) or (msa_features, target_bins)."""
    return model.example_batch(settings.batch, torch.Generator().manual_seed(0))


def make_plans(settings: Settings) -> list[PlanPayload]:
    """Plan every schedule once (in the parent) and read where it cut the model into stages."""
    model = build_model(settings)
    batch = example_batch(model, settings)
    payloads = []
    for name in settings.schedules:
        extra = SCHEDULES[name]
        plan = lnn.parallelize(
            model, batch, name, settings.stages, step="training_step", stages=settings.stages,
            microbatches=settings.microbatches, balance=settings.balance, **extra,
            **({"activation_limit": settings.activation_limit} if name in ("zbv", "vhalf") else {}),
        )
        assert plan.pipeline is not None, f"{name} plans carry a pipeline schedule"
        payload = payload_of(name, stages_per_rank(name), plan, settings.stages)
        payload.stage_ranks = tuple(plan.pipeline.schedule.stage_ranks)
        PLANNED[name] = plan.pipeline.schedule
        payload.chunk_blocks = chunk_blocks(plan, payload, settings)
        payloads.append(payload)
    return payloads


def stages_per_rank(name: str) -> int:
    """Model stages each rank holds under our schedule ``name`` (2 for interleaved with v=2 and the V shapes)."""
    return 2 if name in V_SHAPES else SCHEDULES[name].get("virtual_stages", 1)


def payload_of(name: str, virtual_stages: int, plan: lnn.Plan, ranks: int) -> PlanPayload:
    """What each of ``ranks`` ranks needs of ``plan`` to run it."""
    return PlanPayload(
        name, virtual_stages, plan.sources, dict(plan.graph.constant_values), [tensor.name for tensor in plan.graph.user_inputs],
        [plan.input_offsets(rank) for rank in range(ranks)],
    )


def parameter_stages(plan: lnn.Plan) -> dict[str, set[int]]:
    """Per parameterized unit (``blocks.3.attn``, ``lm_head``, …), the pipeline stages whose segments read its
    parameters in the planned graph (the prologue's segment, stage -1, included)."""
    stages: dict[str, set[int]] = {}
    for op in plan.planned.ops:
        for piece in op.tensor_inputs:
            key = piece.tensor.state_key
            if key and op.segment is not None:
                unit = ".".join(key.split(".")[: 3 if key.startswith("blocks.") else 1])
                stages.setdefault(unit, set()).add(op.segment[0])
    return stages


def chunk_blocks(plan: lnn.Plan, payload: PlanPayload, settings: Settings) -> list[list[int]]:
    """The sub-layers (unit ``4·block + k``, k: ln_1, attn, ln_2, mlp) of each of the ``p·v`` pipeline
    stages, read from the stage whose segments read each parameter, checked against the rank that holds
    it (``HELD``), so that the torch stages are cut where the plan cut: rank r holds stages r, r+p, …
    (looped) or r and 2p-1-r (V), which alone cannot tell a V's two adjacent stages on rank p-1 apart.

    Raises:
        ValueError: the plan cut inside a sub-layer, put the embeddings or the head elsewhere than the
            first and last stage, or the stages do not run through the model in order.
    """
    chunks = settings.stages * payload.virtual_stages
    found, holders = parameter_stages(plan), held_units(payload)
    ends = {"token_embedding": 0, "position_embedding": 0, "ln_f": chunks - 1, "lm_head": chunks - 1}
    for unit, stage in ends.items():
        if found.get(unit) != {stage}:
            raise ValueError(f"{payload.name}: {unit} is read in stages {sorted(found.get(unit, ()))}, not in stage {stage}")
    stages: list[list[int]] = [[] for _ in range(chunks)]
    for unit in range(4 * settings.layers):
        key = f"blocks.{unit // 4}.{SUBLAYERS[unit % 4]}"
        if len(found.get(key, ())) != 1 or holders.get(key) != {payload.stage_ranks[min(found[key])]}:
            raise ValueError(
                f"{payload.name}: {key} is read in stages {sorted(found.get(key, ()))}, held on ranks {sorted(holders.get(key, ()))}"
            )
        stages[next(iter(found[key]))].append(unit)
    if [unit for units in stages for unit in units] != list(range(4 * settings.layers)):
        raise ValueError(f"{payload.name}: the plan's stages do not run through the model's layers in order: {stages}")
    return stages


def held_units(payload: PlanPayload) -> dict[str, set[int]]:
    """Per GPT block sub-layer (``blocks.3.attn``), the ranks whose generated module holds its parameters."""
    holders: dict[str, set[int]] = {}
    for rank, source in enumerate(payload.sources):
        module = module_from_source(source, f"bench_{payload.name}_check{rank}")
        for _, key, _, role in module.HELD.values():
            if role not in ("input", "constant") and key.startswith("blocks."):
                holders.setdefault(".".join(key.split(".")[:3]), set()).add(rank)
    return holders


# --- measurement helpers (ranks) --------------------------------------------------------------------


class TimedCommunicator(TorchDistributedCommunicator):
    """The gloo communicator, recording when each blocking ``recv`` and each collective waited
    (``perf_counter`` seconds): a collective inside an action (the interlaced pipeline's shared
    stages) waits for the slowest rank, which is bubble as much as a receive's wait is."""

    def __init__(self, timeout: float) -> None:
        super().__init__(timeout)
        self.waits: list[tuple[float, float]] = []

    def _timed(self, run: Any) -> Any:
        start = time.perf_counter()
        try:
            return run()
        finally:
            self.waits.append((start, time.perf_counter()))

    def recv(self, shape: Any, dtype: torch.dtype, src: int, tag: int) -> torch.Tensor:
        """Receive as the base class does, timing the wait."""
        return self._timed(lambda: super(TimedCommunicator, self).recv(shape, dtype, src, tag))

    def all_reduce(self, tensor: torch.Tensor, ranks: Any) -> torch.Tensor:
        """All-reduce as the base class does, timing it."""
        return self._timed(lambda: super(TimedCommunicator, self).all_reduce(tensor, ranks))

    def all_gather(self, tensor: torch.Tensor, dim: int, ranks: Any) -> torch.Tensor:
        """All-gather as the base class does, timing it."""
        return self._timed(lambda: super(TimedCommunicator, self).all_gather(tensor, dim, ranks))

    def reduce_scatter(self, tensor: torch.Tensor, dim: int, ranks: Any) -> torch.Tensor:
        """Reduce-scatter as the base class does, timing it."""
        return self._timed(lambda: super(TimedCommunicator, self).reduce_scatter(tensor, dim, ranks))

    def broadcast(self, tensor: torch.Tensor | None, src: int, ranks: Any, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        """Broadcast as the base class does, timing it."""
        return self._timed(lambda: super(TimedCommunicator, self).broadcast(tensor, src, ranks, shape, dtype))


class _Saved:
    """A tensor saved for backward; releases its bytes from the meter when autograd drops it."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: torch.Tensor, meter: ActivationMeter, key: int | None) -> None:
        # Detached: a saved output kept with its grad_fn would make a reference cycle (node -> saved tensor -> node)
        # that outlives the graph wherever backward retains it (zero-bubble's I and W), so its bytes never left the meter.
        self.tensor, self.meter, self.key = tensor.detach(), meter, key

    def __del__(self) -> None:
        if self.key is not None:
            self.meter.release(self.key)


class ActivationMeter:
    """Bytes of distinct storages saved for backward and alive, their peak and their total (parameters excluded)."""

    def __init__(self, excluded: set[int]) -> None:
        self.excluded = excluded
        self.live: dict[int, list[int]] = {}  # storage -> [references, bytes]
        self.current = self.peak = self.total = 0

    def pack(self, tensor: torch.Tensor) -> _Saved:
        """saved_tensors_hooks pack: count the tensor's storage once while any save of it lives."""
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if torch._C._current_autograd_node() is not None or key in self.excluded or not storage.nbytes():
            return _Saved(tensor, self, None)
        entry = self.live.setdefault(key, [0, storage.nbytes()])
        if entry[0] == 0:
            self.current += entry[1]
            self.total += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        return _Saved(tensor, self, key)

    @staticmethod
    def unpack(saved: _Saved) -> torch.Tensor:
        """saved_tensors_hooks unpack."""
        return saved.tensor

    def release(self, key: int) -> None:
        """One save of storage ``key`` was dropped."""
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[key]


COMPUTE_ACTION = re.compile(r"\d+[FBW]\d+")
"""An F, B or W action's text (``3B5``), as the executor records it beside SEND/RECV/REDUCE ones."""


def compute_actions(executed: list[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
    """The F/B/W actions of an executor's ``executed_actions`` (it records its messages and sums too)."""
    return [entry for entry in executed if COMPUTE_ACTION.fullmatch(entry[0])]


def compute_seconds(actions: list[tuple[str, float, float]], waits: list[tuple[float, float]]) -> float:
    """Time inside the actions less the time they spent blocked receiving."""
    total = sum(end - start for _, start, end in actions)
    for start, end in waits:
        if any(a_start <= start and end <= a_end for _, a_start, a_end in actions):
            total -= end - start
    return total


def synced_step(run: Any) -> float:
    """Barrier, ``run()``, barrier: the step's wall time in seconds."""
    dist.barrier()
    start = time.perf_counter()
    run()
    dist.barrier()
    return time.perf_counter() - start


# --- ours (ranks) -----------------------------------------------------------------------------------


def run_ours(rank: int, settings: AnySettings, payload: PlanPayload) -> dict[str, Any]:
    """Warm-up, timed steps (with the action trace) and one metered step of our plan on this rank."""
    model = build_model(settings)
    batch = example_batch(model, settings)
    inputs = dict(zip(payload.input_names, lnn.flatten_inputs(batch, step="training_step")))
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    communicator = TimedCommunicator(settings.collective_timeout)
    module = module_from_source(payload.sources[rank], f"bench_{payload.name}_rank{rank}")
    executor = RankExecutor(module, rank, state, payload.constants, communicator, input_offsets=payload.offsets[rank])

    def step() -> None:
        executor.forward_backward(inputs)

    for _ in range(settings.warmup):
        synced_step(step)
    executor.trace_actions = True
    times, bubbles, outside, computes, spans, trace, waits = [], [], [], [], [], [], []
    for _ in range(settings.steps):
        communicator.waits.clear()
        wall = synced_step(step)
        trace, waits = compute_actions(executor.executed_actions), list(communicator.waits)
        times.append(wall)
        computes.append(compute_seconds(trace, waits))
        bubbles.append(1.0 - computes[-1] / wall)
        outside.append(wall - (trace[-1][2] - trace[0][1]) if trace else wall)
        spans.append((trace[0][1], trace[-1][2]) if trace else (math.inf, -math.inf))
    executor.trace_actions = False
    excluded = {tensor.untyped_storage().data_ptr() for tensor in executor.held.values() if tensor.numel()}
    meter = ActivationMeter(excluded)
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        synced_step(step)
    return {
        "times": times, "bubbles": bubbles, "outside": outside, "computes": computes, "spans": spans,
        "peak": meter.peak, "total": meter.total, "trace": trace, "waits": waits,
    }


def schedule_bubble(ours: list[dict[str, Any]]) -> float:
    """The bubble inside the schedule, as the textbook counts it: per timed step, ``1 - sum of the ranks'
    compute / (ranks × span)``, the span running from the first action any rank starts to the last one
    any rank ends (``perf_counter`` is one monotonic clock for every process of the machine); mean over
    the steps. What runs before the first action or after the last (the prologue, the gradient and
    loss sums, the barriers) is left out: it is the step's overhead, not the schedule's bubble."""
    bubbles = []
    for step in range(len(ours[0]["spans"])):
        start = min(result["spans"][step][0] for result in ours)
        end = max(result["spans"][step][1] for result in ours)
        compute = sum(result["computes"][step] for result in ours)
        bubbles.append(1.0 - compute / (len(ours) * (end - start)))
    return mean(bubbles)


# --- torch.distributed.pipelining (ranks) -----------------------------------------------------------


class StageModule(nn.Module):
    """One pipeline stage of the GPT: [embeddings] + sub-layers + [ln_f + lm_head].

    Between stages flows the residual stream ``x``, and after a cut between a layer norm and its
    attention or MLP also the normalized ``h`` (as in the plan).
    """

    def __init__(self, model: GPT, units: list[int], first: bool, last: bool) -> None:
        super().__init__()
        self.token_embedding = model.token_embedding if first else None
        self.position_embedding = model.position_embedding if first else None
        self.units = units
        # only the stage's own sub-layers: a V's two stages on one rank may split a block between them
        self.parts = nn.ModuleDict({str(unit): getattr(model.blocks[unit // 4], SUBLAYERS[unit % 4]) for unit in units})
        self.dropouts = nn.ModuleDict({str(unit): model.blocks[unit // 4].attn_dropout for unit in units if unit % 4 == 1})
        self.ln_f = model.ln_f if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor, h: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Tokens (first stage) or (x[, h]) -> (x[, h]), or logits (last stage)."""
        if self.token_embedding is not None and self.position_embedding is not None:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.token_embedding(x) + self.position_embedding(positions)
        for unit in self.units:
            layer, part = self.parts[str(unit)], SUBLAYERS[unit % 4]
            if part in ("ln_1", "ln_2"):
                h = layer(x)
            elif part == "attn":
                x, h = x + self.dropouts[str(unit)](layer(h, is_causal=True)), None
            else:
                x, h = x + layer(h), None
        if self.ln_f is not None and self.lm_head is not None:
            return self.lm_head(self.ln_f(x))
        return x if h is None else (x, h)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The GPT's loss on one microbatch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def torch_schedule(rank: int, settings: Settings, payload: PlanPayload) -> tuple[Any, bool, bool]:
    """torch's schedule for ``payload.name`` over hand-built stages on the plan's ranks (looped or V):
    (schedule, holds first, holds last)."""
    from torch.distributed import pipelining

    model = build_model(settings)
    chunks = len(payload.chunk_blocks)
    stage_indices = [index for index, owner in enumerate(payload.stage_ranks) if owner == rank]
    stages = [
        pipelining.PipelineStage(
            StageModule(model, payload.chunk_blocks[index], index == 0, index == chunks - 1), index, chunks, torch.device("cpu")
        )
        for index in stage_indices
    ]
    kind = getattr(pipelining.schedules, TORCH_SCHEDULES[payload.name])
    single = issubclass(kind, pipelining.schedules.PipelineScheduleSingle)
    schedule = kind(stages[0] if single else stages, settings.microbatches, loss_fn=cross_entropy)
    return schedule, 0 in stage_indices, chunks - 1 in stage_indices


def run_torch(rank: int, settings: Settings, payload: PlanPayload) -> dict[str, Any]:
    """Warm-up and timed steps of torch.distributed.pipelining's schedule on this rank."""
    schedule, first, last = torch_schedule(rank, settings, payload)
    tokens, targets = example_batch(build_model(settings), settings)
    args = (tokens,) if first else ()
    kwargs = {"target": targets, "losses": []} if last else {}

    def step() -> None:
        if last:
            kwargs["losses"] = []
        schedule.step(*args, return_outputs=False, **kwargs)

    for _ in range(settings.warmup):
        synced_step(step)
    return {"times": [synced_step(step) for _ in range(settings.steps)]}


def run_peer(rank: int, settings: Settings, payload: PlanPayload, broken: list[str]) -> dict[str, Any]:
    """``run_torch``, or ``{"error": why}``; a peer failure that leaves the process group unusable is
    recorded in ``broken`` and skips the peers after it."""
    if payload.name not in TORCH_SCHEDULES:
        return {"error": "torch ships none"}
    if not settings.torch_peers:
        return {"error": "not run (--without-torch)"}
    if broken:
        return {"error": f"not run: the process group broke during {broken[0]}"}
    try:
        return run_torch(rank, settings, payload)
    except Exception as error:  # noqa: BLE001 - reported in the table
        try:
            dist.barrier()
        except Exception:  # noqa: BLE001 - the group is gone
            broken.append(payload.name)
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}


def rank_main(rank: int, world_size: int, settings: Settings, payloads: list[PlanPayload]) -> dict[str, Any]:
    """Every schedule on this rank, ours then torch's, in ``settings.rounds`` rounds (a machine whose
    speed drifts over minutes slows both sides of a round alike); per schedule name, a list of rounds each."""
    prepare_rank(settings)
    results: dict[str, Any] = {name: {"ours": [], "torch": []} for name in settings.schedules}
    broken: list[str] = []
    for _ in range(settings.rounds):
        for payload in payloads:
            results[payload.name]["ours"].append(run_ours(rank, settings, payload))
            results[payload.name]["torch"].append(run_peer(rank, settings, payload, broken))
    return results


M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
"""``mallopt``'s parameter numbers (glibc's malloc.h)."""


def cache_freed_memory() -> None:
    """Keep freed memory in this process for its next tensors, as a GPU's caching allocator keeps device memory.

    By default glibc maps each block above its mmap threshold afresh and unmaps it when freed, and gives the heap's
    free top back to the system: the next tensor of that size then faults its pages in again (zeroed by the kernel).
    A schedule whose step holds more tensors at once (a split backward keeps its graph from I to W) pays that more
    often: ``--only split`` counts the page faults of each variant (F+I+W with W three microbatches late faulted about
    6,000 pages per run with glibc's defaults, none with this). Heap blocks up to 32 MiB (glibc's largest
    threshold), no trimming of the heap's top, 64 MiB of slack.
    """
    libc = ctypes.CDLL("libc.so.6")
    for parameter, value in ((M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 1 << 30), (M_TOP_PAD, 64 << 20)):
        if not libc.mallopt(parameter, value):
            raise RuntimeError(f"mallopt({parameter}, {value}) was refused")


def prepare_rank(settings: Measurement) -> None:
    """One intra-op thread (the ranks share the cores: more only contend), and freed memory kept unless asked not to."""
    torch.set_num_threads(1)
    if settings.caching_malloc:
        cache_freed_memory()


# --- report (parent) --------------------------------------------------------------------------------


def theory_bubble(name: str, settings: Settings) -> float:
    """Textbook bubble: (p-1)/(m+p-1), interleaved (p-1)/(v m+p-1); the zero-bubble and V schedules
    (ZB-H1, ZB-V, V-Half, DualPipeV) simulated with F = B = W (``bubble_fraction``)."""
    p, m = settings.stages, settings.microbatches
    if name in ("zb1", *V_SHAPES):
        return bubble_fraction(compute_schedule(name, settings))
    return theoretical_bubble_fraction(p, m, SCHEDULES[name].get("virtual_stages", 1))


PLANNED: dict[str, Schedule] = {}
"""The compute-only order each plan runs, by schedule name (``make_plans`` fills it in the parent): the V recipes make
theirs in their cut stages' time, which the generator in unit time does not give."""


def planned_schedule(name: str, settings: Settings) -> Schedule:
    """The order the plan ``name`` runs (``PLANNED``), else the generator's."""
    return PLANNED.get(name) or compute_schedule(name, settings)


def compute_schedule(name: str, settings: Settings) -> Schedule:
    """The schedule's generator in unit time (F = B = W), whose bubble is the theory column's."""
    p, m = settings.stages, settings.microbatches
    generators = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb1": zb1, "zbv": zbv, "vhalf": v_half, "dualpipev": dual_pipe_v}
    return interleaved(p, SCHEDULES[name]["virtual_stages"], m) if name == "interleaved" else generators[name](p, m)


def expected_in_flight(name: str, settings: Settings) -> list[float]:
    """Per rank, the schedule's peak stashed microbatches in units of a rank's whole share (a stage of 2 per rank counts 1/2)."""
    return [count / stages_per_rank(name) for count in peak_in_flight(planned_schedule(name, settings))]


def replayed_bubble(ours: list[dict[str, Any]], schedule: Schedule) -> float:
    """The bubble the schedule itself leaves given the actions' measured compute times: the last timed
    step's actions (less their waits for peers) replayed as soon as their order and dependencies allow,
    with instant messages (``schedules.execute``). Measured minus this is what communication and the
    runtime add; this minus the textbook value is what unequal stages and F/B ratios add."""
    seconds: dict[str, float] = {}
    for result in ours:
        for text, start, end in result["trace"]:
            waited = sum(min(end, wait_end) - max(start, wait_start) for wait_start, wait_end in result["waits"] if wait_start < end and wait_end > start)
            seconds[text] = end - start - waited
    timeline = execute(schedule, lambda action: seconds[str(action)])
    return 1.0 - sum(seconds.values()) / (schedule.world_size * timeline.makespan)


def compute_by_rank(ours_rounds: list[list[dict[str, Any]]]) -> list[float]:
    """Per rank, the median over rounds and timed steps of its compute (time inside its actions less its waits), in s."""
    return [statistics.median(value for ours in ours_rounds for value in ours[rank]["computes"]) for rank in range(len(ours_rounds[0]))]


def mean(values: list[float]) -> float:
    """Arithmetic mean."""
    return sum(values) / len(values)


def step_ms(per_rank_times: list[list[float]]) -> float:
    """Median over the timed steps of the slowest rank's step wall time, in ms (robust to a noisy step)."""
    return 1e3 * statistics.median(max(steps) for steps in zip(*per_rank_times))


def root_error(errors: list[str | None]) -> str | None:
    """The error that caused the others: the first that is not a peer's timeout or closed connection."""
    found = [error for error in errors if error]
    causes = [error for error in found if not any(text in error for text in ("Timed out", "Connection closed", "not run:"))]
    return (causes or found or [None])[0]


def table(per_rank: list[dict[str, Any]], settings: Settings) -> str:
    """The summary table, one row per schedule."""
    header = ["schedule", "ours ms/step", "torch ms/step", "ratio [min, max]", "compute ms/step by rank", "bubble (step)", "bubble (schedule)", "bubble (replayed)", "theory bubble",
              *(f"act stage{rank}" for rank in range(settings.stages))]
    rows = []
    for name in settings.schedules:
        rounds = range(settings.rounds)
        ours_rounds = [[results[name]["ours"][index] for results in per_rank] for index in rounds]
        ours_ms = [step_ms([result["times"] for result in ours]) for ours in ours_rounds]
        error = root_error([result.get("error") for results in per_rank for result in results[name]["torch"]])
        torch_ms = None if error else [step_ms([results[name]["torch"][index]["times"] for results in per_rank]) for index in rounds]
        ratios = None if torch_ms is None else sorted(ours / theirs for ours, theirs in zip(ours_ms, torch_ms))
        bubble = mean([value for ours in ours_rounds for result in ours for value in result["bubbles"]])
        expected = expected_in_flight(name, settings)
        memory = [
            f"{result['peak'] * settings.microbatches / result['total']:.2f} ({expected[rank]:g})" for rank, result in enumerate(ours_rounds[-1])
        ]
        rows.append([
            name, f"{statistics.median(ours_ms):.1f}", "n/a" if torch_ms is None else f"{statistics.median(torch_ms):.1f}",
            "n/a" if ratios is None else f"{statistics.median(ratios):.2f} [{ratios[0]:.2f}, {ratios[-1]:.2f}]",
            "/".join(f"{1e3 * value:.0f}" for value in compute_by_rank(ours_rounds)), f"{bubble:.3f}",
            f"{mean([schedule_bubble(ours) for ours in ours_rounds]):.3f}",
            f"{mean([replayed_bubble(ours, planned_schedule(name, settings)) for ours in ours_rounds]):.3f}", f"{theory_bubble(name, settings):.3f}", *memory,
        ])
        if error:
            rows[-1].append(f"torch: {error}")
    widths = [max(len(str(row[column])) for row in [header, *rows] if column < len(row)) for column in range(len(header))]
    lines = [" | ".join(text.ljust(width) for text, width in zip(header, widths))]
    lines.append("-+-".join("-" * width for width in widths))
    for row in rows:
        lines.append(" | ".join(text.ljust(width) for text, width in zip(row, widths)).rstrip() + (f"  {row[-1]}" if len(row) > len(header) else ""))
    return "\n".join(lines)


def timeline(ours: list[dict[str, Any]], name: str, columns: int = 100) -> str:
    """Each rank's last timed step (``ours[rank]``: ``run_ours``'s result) of ``name`` as a bar: digit k =
    F of microbatch k, letter a.. = B, A.. = W, '.' = idle or waiting for a peer."""
    starts = [result["trace"][0][1] for result in ours if result["trace"]]
    ends = [result["trace"][-1][2] for result in ours if result["trace"]]
    origin, span = min(starts), max(ends) - min(starts)
    lines = [f"{name}: executed actions of the last timed step ({1e3 * span:.0f} ms, {span * 1e3 / columns:.1f} ms per column; "
             "digit k: F of microbatch k, a..: B, A..: W, '.': idle or receiving)"]
    for rank, result in enumerate(ours):
        cells = ["."] * columns
        for text, start, end in result["trace"]:
            _, kind, microbatch = _parse(text)
            mark = str(microbatch % 10) if kind == "F" else chr((ord("a") if kind == "B" else ord("A")) + microbatch % 26)
            for column in range(_column(start, origin, span, columns), _column(end, origin, span, columns)):
                cells[column] = mark
        for start, end in result["waits"]:
            for column in range(_column(start, origin, span, columns), _column(end, origin, span, columns)):
                cells[column] = "."
        lines.append(f"rank {rank} |{''.join(cells)}|")
    return "\n".join(lines)


def _parse(text: str) -> tuple[int, str, int]:
    """'12B3' -> (12, 'B', 3)."""
    index = next(position for position, char in enumerate(text) if char.isalpha())
    return int(text[:index]), text[index], int(text[index + 1 :])


def _column(moment: float, origin: float, span: float, columns: int) -> int:
    return min(columns, max(0, round((moment - origin) / span * columns)))


# --- 3F1B on a recycling model (issue 9) ------------------------------------------------------------

RECYCLING_BASELINE = "gpipe+recycling outside"
"""The baseline's row: GPipe on the gradient pass, the recycling passes run before it as forward pipelines."""


def recycling_outside_schedule(schedule: Schedule) -> Schedule:
    """GPipe with the recycling passes outside the pipeline, over ``schedule``'s stages and ranks.

    Each rank runs its forward-only (recycling) stages in increasing order, each over all microbatches
    (pass 0's stage, then pass 1's), then GPipe on its gradient-pass stage(s): every F, then every B in
    microbatch order (``schedules.gpipe``; with several gradient stages on a rank, B in reverse stage
    order). The lowering must validate (messages paired in order, no cross-rank cycle).

    Raises:
        ScheduleError: the hand-built order would hang or cross messages (with the step × rank grid).
    """
    m = schedule.microbatches
    actions = []
    for rank in range(schedule.world_size):
        stages = schedule.stages_of_rank(rank)
        recycling = [stage for stage in stages if not schedule.has_backward(stage)]
        gradient = [stage for stage in stages if schedule.has_backward(stage)]
        actions.append(
            [Action(stage, microbatch, Kind.FORWARD) for stage in recycling for microbatch in range(m)]
            + [Action(stage, microbatch, Kind.FORWARD) for stage in gradient for microbatch in range(m)]
            + [Action(stage, microbatch, Kind.BACKWARD) for stage in reversed(gradient) for microbatch in range(m)]
        )
    baseline = Schedule(actions, schedule.stage_ranks, m, schedule.forward_only)
    validate(lower(baseline))
    return baseline


PAPER_ORDER = "3f1b, the paper's interleaved order"
"""A third row: nnScaler's 3F1B order (``schedules.interleaved_recycling``), on the same stages."""


def make_recycling_plans(settings: RecyclingSettings) -> tuple[list[PlanPayload], dict[str, Schedule]]:
    """Plan 3F1B once, and the baseline from the same planned graph and stage cut with its hand-built
    schedule (only the generated SCHEDULE differs): payloads, and the schedules by row name."""
    model = build_model(settings)
    batch = example_batch(model, settings)
    plan = lnn.parallelize(model, batch, "3f1b", settings.stages, step="training_step", microbatches=settings.microbatches)
    assert plan.pipeline is not None, "3f1b plans carry a pipeline schedule"
    baseline = recycling_outside_schedule(plan.pipeline.schedule)
    baseline_plan = build_plan(
        model, batch, "training_step", plan.graph, plan.planned, settings.stages, recipe="gpipe-recycling-outside",
        pipeline=PipelinePlan(baseline, plan.pipeline.column_of_rank), layout=plan.layout,
    )
    schedule = plan.pipeline.schedule
    paper = interleaved_recycling(schedule.world_size, schedule.microbatches, schedule.stages // schedule.world_size)
    paper_plan = build_plan(
        model, batch, "training_step", plan.graph, plan.planned, settings.stages, recipe="3f1b-interleaved",
        pipeline=PipelinePlan(paper, plan.pipeline.column_of_rank), layout=plan.layout,
    )
    rows = ((RECYCLING_BASELINE, baseline_plan), ("3f1b", plan), (PAPER_ORDER, paper_plan))
    payloads = [payload_of(name, settings.recycles, planned, settings.stages) for name, planned in rows]
    return payloads, {RECYCLING_BASELINE: baseline, "3f1b": schedule, PAPER_ORDER: paper}


def recycling_rank_main(rank: int, world_size: int, settings: RecyclingSettings, payloads: list[PlanPayload]) -> dict[str, Any]:
    """Every recycling schedule on this rank (ours only: torch has no forward-only stages); results by name."""
    prepare_rank(settings)
    return {payload.name: {"ours": run_ours(rank, settings, payload)} for payload in payloads}


def recycling_table(per_rank: list[dict[str, Any]], settings: AnySettings, schedules: dict[str, Schedule], baseline: str = RECYCLING_BASELINE) -> str:
    """A comparison table (3F1B's, the interlaced pipeline's): ms/step, speed-up over ``baseline``,
    measured and symbolic bubble, activation peaks."""
    header = ["schedule", "ms/step", "speed-up vs baseline", "measured bubble", "theory bubble",
              *(f"act stage{rank}" for rank in range(settings.stages))]
    milliseconds = {name: step_ms([results[name]["ours"]["times"] for results in per_rank]) for name in schedules}
    rows = []
    for name, schedule in schedules.items():
        ours = [results[name]["ours"] for results in per_rank]
        bubble = mean([value for result in ours for value in result["bubbles"]])
        expected = peak_in_flight(schedule)
        memory = [f"{result['peak'] * settings.microbatches / result['total']:.2f} ({expected[rank]:g})" if result["total"] else "n/a"
                  for rank, result in enumerate(ours)]
        rows.append([name, f"{milliseconds[name]:.1f}", f"{milliseconds[baseline] / milliseconds[name]:.2f}",
                     f"{bubble:.3f}", f"{bubble_fraction(schedule):.3f}", *memory])
    widths = [max(len(row[column]) for row in [header, *rows]) for column in range(len(header))]
    lines = [" | ".join(text.ljust(width) for text, width in zip(header, widths)), "-+-".join("-" * width for width in widths)]
    lines += [" | ".join(text.ljust(width) for text, width in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def run_recycling(quick: bool, steps: int | None, caching_malloc: bool = True) -> None:
    """Plan and run the recycling schedules on 4 gloo ranks; print the 3F1B table and both timelines."""
    settings = RecyclingSettings(n_res=32, steps=2, warmup=1) if quick else RecyclingSettings()
    settings = dataclasses.replace(settings, caching_malloc=caching_malloc)
    if steps:
        settings = dataclasses.replace(settings, steps=steps)
    started = time.perf_counter()
    print(f"Evoformer n_seq {settings.n_seq}, n_res {settings.n_res}, c_m {settings.c_m}, c_z {settings.c_z}, {settings.blocks} blocks, "
          f"{settings.recycles} passes ({settings.recycles - 1} no-grad), batch {settings.batch}; p = {settings.stages} gloo CPU ranks "
          f"(1 thread each), m = {settings.microbatches}; {settings.warmup} warm-up + {settings.steps} timed steps; torch {torch.__version__}")
    payloads, schedules = make_recycling_plans(settings)
    print(f"planned 3f1b and its baseline in {time.perf_counter() - started:.1f} s")
    try:
        per_rank = launch(recycling_rank_main, settings.stages, settings, payloads, timeout=settings.run_timeout,
                          collective_timeout=settings.collective_timeout)
    except LaunchError as error:
        raise SystemExit(f"benchmark failed: {error}") from None
    print(recycling_table(per_rank, settings, schedules))
    print("ms/step: median over timed steps of the slowest rank; speed-up: baseline ms / row ms (goal >= 1.2 for 3f1b); "
          "measured bubble: mean over ranks and timed steps; theory: bubble_fraction of the schedule (F = 1, B = 2)")
    print("act stageN: peak saved-for-backward bytes / one microbatch of that rank's gradient stage (schedule's peak in-flight count)")
    for name in schedules:
        print(timeline([results[name]["ours"] for results in per_rank], name))
    print(f"wall time {time.perf_counter() - started:.0f} s")


def run_vocabulary(quick: bool, steps: int | None, caching_malloc: bool = True) -> None:
    """Plan 1F1B and the interlaced pipeline on the large-vocabulary model, run both on 4 gloo ranks, print the table."""
    settings = VocabularySettings(vocab=8192, steps=2, warmup=1) if quick else VocabularySettings()
    settings = dataclasses.replace(settings, caching_malloc=caching_malloc)
    if steps:
        settings = dataclasses.replace(settings, steps=steps)
    started = time.perf_counter()
    print(f"mBART-style vocab {settings.vocab}, hidden {settings.hidden}, {settings.encoder_layers}+{settings.decoder_layers} layers, "
          f"seq {settings.seq_len}, batch {settings.batch}; p = {settings.stages} gloo CPU ranks (1 thread each), m = {settings.microbatches}; "
          f"{settings.warmup} warm-up + {settings.steps} timed steps; stages cut by {settings.balance} cost; "
          f"{'freed memory kept (cache_freed_memory)' if settings.caching_malloc else 'glibc malloc defaults'}; torch {torch.__version__}")
    model = build_model(settings)
    batch = example_batch(model, settings)
    payloads, schedules = [], {}
    for name in ("1f1b", "interlaced"):
        plan = lnn.parallelize(model, batch, name, settings.stages, step="training_step", microbatches=settings.microbatches)
        payloads.append(payload_of(name, 1, plan, settings.stages))
        schedules[name] = plan.pipeline.schedule
    print(f"planned 1f1b and interlaced in {time.perf_counter() - started:.1f} s")
    try:
        per_rank = launch(recycling_rank_main, settings.stages, settings, payloads, timeout=settings.run_timeout,
                          collective_timeout=settings.collective_timeout)
    except LaunchError as error:
        raise SystemExit(f"benchmark failed: {error}") from None
    print(recycling_table(per_rank, settings, schedules, baseline="1f1b"))
    print("ms/step: median over timed steps of the slowest rank; speed-up: 1f1b ms / row ms (goal >= 1.3 for interlaced); "
          "measured bubble: mean over ranks and timed steps; theory: bubble_fraction of the schedule (F = 1, B = 2 per action, "
          "a shared stage's action as long as a stage's)")
    print("act stageN: peak saved-for-backward bytes / one microbatch of that rank's actions (schedule's peak in-flight count)")
    for name in schedules:
        print(timeline([results[name]["ours"] for results in per_rank], name))
    print(f"wall time {time.perf_counter() - started:.0f} s")


def zb1_against_1f1b(per_rank: list[dict[str, Any]], settings: Settings) -> str:
    """Same run, ZB-H1 against 1F1B: per rank, compute (F+I+W against F+B) and the step time."""
    def of(name: str) -> tuple[list[float], float]:
        ours_rounds = [[results[name]["ours"][index] for results in per_rank] for index in range(settings.rounds)]
        return compute_by_rank(ours_rounds), statistics.median(step_ms([result["times"] for result in ours]) for ours in ours_rounds)

    (zb1_compute, zb1_step), (base_compute, base_step) = of("zb1"), of("1f1b")
    ratios = ", ".join(f"rank {rank} {ours / theirs:.3f}" for rank, (ours, theirs) in enumerate(zip(zb1_compute, base_compute)))
    return f"zb1 / 1f1b, same run: compute per rank (F+I+W / F+B) {ratios}; ms/step {zb1_step:.1f} / {base_step:.1f} = {zb1_step / base_step:.3f}"


def rounds_of(per_rank: list[dict[str, Any]], settings: Settings, name: str) -> list[list[dict[str, Any]]]:
    """Our results of ``name``: per round, per rank (``run_ours``'s result)."""
    return [[results[name]["ours"][index] for results in per_rank] for index in range(settings.rounds)]


def step_and_peak(per_rank: list[dict[str, Any]], settings: Settings, name: str) -> tuple[float, int]:
    """``name``'s ms/step as the table gives it (median over rounds) and its activation peak in bytes (max over ranks)."""
    ours_rounds = rounds_of(per_rank, settings, name)
    milliseconds = statistics.median(step_ms([result["times"] for result in ours]) for ours in ours_rounds)
    return milliseconds, max(result["peak"] for result in ours_rounds[-1])


def issue_goals(per_rank: list[dict[str, Any]], settings: Settings) -> list[str]:
    """Issue 38's comparisons against 1F1B in the same run: ZB-V's throughput and activation peak, V-Half's
    activation peak (bytes, max over ranks), and 1F1B's measured bubble less the textbook's, in points."""
    if "1f1b" not in settings.schedules:
        return []
    base_ms, base_peak = step_and_peak(per_rank, settings, "1f1b")

    def verdict(value: float, goal: float, at_least: bool) -> str:
        met = value >= goal if at_least else value <= goal
        return f"{value:.3f} (goal {'>=' if at_least else '<='} {goal:g}: {'met' if met else 'missed'})"

    lines = []
    if "zbv" in settings.schedules:
        ms, peak = step_and_peak(per_rank, settings, "zbv")
        lines.append(f"zbv / 1f1b: throughput (1f1b ms / zbv ms) {verdict(base_ms / ms, 1.15, True)}; "
                     f"activation peak {verdict(peak / base_peak, 1.0, False)} [{peak / 2**20:.2f} / {base_peak / 2**20:.2f} MiB]")
    if "vhalf" in settings.schedules:
        _, peak = step_and_peak(per_rank, settings, "vhalf")
        lines.append(
            f"vhalf / 1f1b: activation peak {verdict(peak / base_peak, 0.6, False)} [{peak / 2**20:.2f} / {base_peak / 2**20:.2f} MiB]"
        )
    lines += timed_order_lines(per_rank, settings)
    ours_rounds, theory = rounds_of(per_rank, settings, "1f1b"), theory_bubble("1f1b", settings)
    measured = mean([schedule_bubble(ours) for ours in ours_rounds])
    step = mean([value for ours in ours_rounds for result in ours for value in result["bubbles"]])
    lines.append(f"1f1b bubble (schedule) - theory: {100 * (measured - theory):+.1f} points ({measured:.3f} - {theory:.3f}; goal <= 5: "
                 f"{'met' if 100 * (measured - theory) <= 5 else 'missed'}); bubble (step) - theory: {100 * (step - theory):+.1f} points")
    return lines


def timed_order_lines(per_rank: list[dict[str, Any]], settings: Settings) -> list[str]:
    """For each V schedule run whose plan ordered its actions in its cut stages' time: the replayed bubble of that order
    against the paper's unit-time order's, both in the same measured action times (what the timed order saved)."""
    lines = []
    for name in ("zbv", "vhalf"):
        planned, paper_order = PLANNED.get(name), compute_schedule(name, settings)
        if name not in settings.schedules or planned is None or planned == paper_order:
            continue
        rounds = rounds_of(per_rank, settings, name)
        timed, paper = (mean([replayed_bubble(ours, schedule) for ours in rounds]) for schedule in (planned, paper_order))
        lines.append(f"{name}: the order made in stage time replays at bubble {timed:.3f}, the paper's unit-time order at {paper:.3f} "
                     "(same action times)")
    return lines


def run_split(quick: bool, compile: bool = False, caching_malloc: bool = True, hidden: int | None = None, rows: int | None = None) -> None:
    """One rank, no peers: a middle stage's m microbatches as 1F1B runs them (F, B each) and as ZB-H1
    does (F, I each, every W trailing its I by ``delay`` microbatches: rank r of ZB-H1 delays by r,
    the rest at the end), with W as ``runtime.split_backward`` runs it, as torch.distributed.pipelining
    splits it (``stage_backward_input`` / ``stage_backward_weight``), and as it ran before issue 38
    (the root differentiated again with ``inputs=`` the parameters). Median of the rounds, in ms.

    With ``compile``, the stage runs under ``torch.compile`` (inductor): F+B with its backward whole, and F+I+W with
    its backward split into compiled halves (``runtime.compiled_split``) against the whole compiled backward run in
    both I and W (as before the split). ``hidden`` and ``rows`` (per microbatch) size the stage's ops: the split's cost
    is about constant per autograd node, so its share falls as the ops grow."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from lightning_nnscaler.runtime.split_backward import input_gradients

    settings = Settings(hidden=64, vocab=128, seq_len=32, rounds=3, caching_malloc=caching_malloc) if quick else Settings(rounds=9, caching_malloc=caching_malloc)
    settings = dataclasses.replace(settings, hidden=hidden or settings.hidden, batch=(rows or settings.batch // settings.microbatches) * settings.microbatches)
    prepare_rank(settings)
    torch.manual_seed(0)
    stage = nn.Sequential(*build_model(settings).blocks[: settings.layers // settings.stages])
    parameters = list(stage.parameters())
    rows = settings.batch // settings.microbatches
    inputs = [torch.randn(rows, settings.seq_len, settings.hidden) for _ in range(settings.microbatches)]
    output_gradient = torch.randn(rows, settings.seq_len, settings.hidden)

    def ours(leaf: torch.Tensor, output: torch.Tensor) -> Any:
        return input_gradients((output * output_gradient).sum(), [leaf], parameters)[1].accumulate

    def torch_split(leaf: torch.Tensor, output: torch.Tensor) -> Any:
        _, groups = stage_backward_input([output], [output_gradient], [leaf], iter(parameters))
        return lambda: stage_backward_weight(iter(parameters), groups)

    def rewalk(leaf: torch.Tensor, output: torch.Tensor) -> Any:
        root = (output * output_gradient).sum()
        torch.autograd.grad(root, [leaf], retain_graph=True)
        return lambda: root.backward(inputs=parameters)

    def run(split: Any, delay: int, model: Any = stage) -> None:
        deferred = []
        for tensor in inputs:
            leaf = tensor.clone().requires_grad_()
            output = model(leaf)
            if split is None:
                (output * output_gradient).sum().backward()
                continue
            deferred.append(split(leaf, output))
            if len(deferred) > delay:
                deferred.pop(0)()
        for weights in deferred:
            weights()

    delays = sorted({0, 1, settings.stages - 1})
    variants = {"F+B (1f1b)": (None, 0)}
    for delay in delays:
        variants |= {f"F+I+W ours, W delay {delay}": (ours, delay), f"F+I+W torch, W delay {delay}": (torch_split, delay)}
    variants["F+I+W re-walk (before), delay 0"] = (rewalk, 0)
    if compile:
        variants = compiled_split_variants(stage, ours, delays)
    times: dict[str, list[float]] = {name: [] for name in variants}
    faults: dict[str, list[int]] = {name: [] for name in variants}
    for _ in range(settings.rounds + 1):  # the first round warms up
        for name, (split, delay, *model) in variants.items():
            stage.zero_grad(set_to_none=True)
            faulted, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
            run(split, delay, *model)
            times[name].append(time.perf_counter() - start)
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faulted)
    base = statistics.median(times["F+B (1f1b)"][1:])
    print(f"{'compiled (inductor), ' if compile else ''}{'freed memory kept, ' if settings.caching_malloc else 'glibc malloc defaults, '}one rank, {len(stage)} GPT blocks (hidden {settings.hidden}, seq {settings.seq_len}), {settings.microbatches} microbatches "
          f"of {rows} rows, 1 thread, median of {settings.rounds} rounds:")
    for name, values in times.items():
        print(f"  {name:42s} {1e3 * statistics.median(values[1:]):7.1f} ms  ({statistics.median(values[1:]) / base:.3f} x F+B), "
              f"{statistics.median(faults[name][1:]):.0f} page faults")


def compiled_split_variants(stage: nn.Module, ours: Any, delays: list[int]) -> dict[str, tuple[Any, int, Any]]:
    """``run_split``'s variants under ``torch.compile`` (inductor): F+B, and F+I+W with the split compiled backward and
    with the whole one (each graph's backward run in I and again in W)."""
    import torch._functorch.config

    from lightning_nnscaler.runtime.compiled_split import SplitBackend

    torch._functorch.config.donated_buffer = False  # I retains the graph (as runtime.compiled sets for W modules)

    def whole_stage(x: torch.Tensor) -> torch.Tensor:  # two functions: Dynamo keeps one compiled frame per code object
        return stage(x)

    def split_stage(x: torch.Tensor) -> torch.Tensor:
        return stage(x)

    whole, split = torch.compile(whole_stage), torch.compile(split_stage, backend=SplitBackend("inductor"))
    variants: dict[str, tuple[Any, int, Any]] = {"F+B (1f1b)": (None, 0, whole)}
    for delay in delays:
        variants[f"F+I+W split compiled, W delay {delay}"] = (ours, delay, split)
        variants[f"F+I+W whole compiled (before), delay {delay}"] = (ours, delay, whole)
    return variants


def main() -> None:
    """Run the GPT table (every schedule vs torch) and the recycling table (3F1B vs its baseline), or one of them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller models and fewer steps (a smoke test)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per schedule")
    parser.add_argument("--only", choices=("gpt", "recycling", "vocabulary", "split"), default=None, help="run one table (default: all three)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help="GPT table: comma-separated schedules (default: all)")
    parser.add_argument("--compile", action="store_true", help="split table: the stage under torch.compile (inductor)")
    parser.add_argument("--ranks", type=int, default=None, help="GPT table: pipeline ranks p (default 4; 2 gives each rank a core of 2)")
    parser.add_argument("--rounds", type=int, default=None, help="GPT table: rounds of every schedule, ours then torch's (default 3; --quick 1)")
    parser.add_argument("--without-torch", action="store_true", help="GPT table: our schedules only")
    parser.add_argument("--balance", choices=("estimate", "measured"), default="estimate",
                        help="GPT table: price the stage cut by op work estimated from shapes, or by op times measured here")
    parser.add_argument("--activation-limit", choices=("stages", "bytes"), default="stages",
                        help="GPT table: what ZB-V's and V-Half's memory limit counts: stages alike (the paper's), or each stage's saved bytes")
    parser.add_argument("--hidden", type=int, default=None, help="split table: the blocks' width (default 256)")
    parser.add_argument("--rows", type=int, default=None, help="split table: rows per microbatch (default 2)")
    parser.add_argument("--glibc-default", action="store_true", help="leave glibc's malloc at its defaults (see cache_freed_memory)")
    arguments = parser.parse_args()
    caching = not arguments.glibc_default
    if arguments.only == "split":
        run_split(arguments.quick, arguments.compile, caching, arguments.hidden, arguments.rows)
    if arguments.only in (None, "gpt"):
        run_gpt(arguments.quick, arguments.steps, tuple(arguments.schedules.split(",")), arguments.ranks, arguments.rounds,
                torch_peers=not arguments.without_torch, balance=arguments.balance, caching_malloc=caching,
                activation_limit=arguments.activation_limit)
    if arguments.only in (None, "recycling"):
        run_recycling(arguments.quick, arguments.steps, caching)
    if arguments.only in (None, "vocabulary"):
        run_vocabulary(arguments.quick, arguments.steps, caching)


def run_gpt(quick: bool, steps: int | None, schedules: tuple[str, ...] = tuple(SCHEDULES), ranks: int | None = None,
            rounds: int | None = None, *, torch_peers: bool = True, balance: str = "estimate", caching_malloc: bool = True,
            activation_limit: str = "stages") -> None:
    """Plan, run the schedules on 4 gloo ranks, print the table, issue 38's comparisons and the 1F1B timeline."""
    unknown = set(schedules) - set(SCHEDULES)
    if unknown:
        raise SystemExit(f"unknown schedules {sorted(unknown)}; choose from {list(SCHEDULES)}")
    settings = Settings(hidden=64, vocab=128, seq_len=32, steps=2, warmup=1, rounds=1) if quick else Settings()
    settings = dataclasses.replace(settings, schedules=schedules, stages=ranks or settings.stages, torch_peers=torch_peers, balance=balance,
                                   caching_malloc=caching_malloc, activation_limit=activation_limit)
    if steps:
        settings = dataclasses.replace(settings, steps=steps)
    if rounds:
        settings = dataclasses.replace(settings, rounds=rounds)
    started = time.perf_counter()
    print(f"GPT hidden {settings.hidden}, {settings.layers} layers, seq {settings.seq_len}, vocab {settings.vocab}, batch {settings.batch}; "
          f"p = {settings.stages} gloo CPU ranks (1 thread each), m = {settings.microbatches}; "
          f"{settings.warmup} warm-up + {settings.steps} timed steps; stages cut by {settings.balance} cost; "
          f"V activation limit in {settings.activation_limit}; "
          f"{'freed memory kept (cache_freed_memory)' if settings.caching_malloc else 'glibc malloc defaults'}; torch {torch.__version__}")
    payloads = make_plans(settings)
    print(f"planned {len(payloads)} schedules in {time.perf_counter() - started:.1f} s")
    try:
        per_rank = launch(rank_main, settings.stages, settings, payloads, timeout=settings.run_timeout, collective_timeout=settings.collective_timeout)
    except LaunchError as error:
        raise SystemExit(f"benchmark failed: {error}") from None
    print(table(per_rank, settings))
    print(f"ms/step: median over {settings.rounds} rounds (ours then torch, schedule by schedule) of the median over timed steps of the "
          "slowest rank; ratio: median of the rounds' ours / torch [lowest, highest]; bubble (step): mean over ranks and timed steps of 1 - compute / wall; "
          "bubble (schedule): 1 - compute / (ranks × span from the first action to the last), mean over timed steps; "
          "bubble (replayed): the schedule replayed with the measured action times and instant messages")
    print("act stageN: peak saved-for-backward bytes / one microbatch of that rank's stage(s) (schedule's expected in-flight count)")
    print("of the step, outside the action list (prologue, loss sum, barriers; counted as bubble), ms: " + ", ".join(
        f"{name} {1e3 * mean([value for results in per_rank for ours in results[name]['ours'] for value in ours['outside']]):.1f}"
        for name in settings.schedules
    ))
    if {"1f1b", "zb1"} <= set(settings.schedules):
        print(zb1_against_1f1b(per_rank, settings))
    for line in issue_goals(per_rank, settings):
        print(line)
    if "1f1b" in settings.schedules:
        print(timeline([results["1f1b"]["ours"][-1] for results in per_rank], "1f1b"))
    print(f"wall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
