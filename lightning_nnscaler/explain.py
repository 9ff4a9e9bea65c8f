"""What each rank of a plan holds and sends per step: the rows of ``Plan.explain`` and of the logged plan.

Memory is what the runtime allocates (``runtime.executor`` and ``runtime.reducer``), per ZeRO stage:

==================  ============================  ===============================  ==========================
bytes per rank      stage 0 (dp)                  stage 1 (zero1)                  stage 3 (zero3)
==================  ============================  ===============================  ==========================
parameters          every box it holds            boxes + its chunk of each        its chunks (boxes freed)
                                                  replicated box
gradients           1× every box it holds         its chunks' gradients            its chunks' gradients
                    (replicated: bucket views)
optimizer           2 × what it steps: boxes      2 × (its chunks + unreplicated   same as stage 1
                                                  boxes)
transient           0                             replicated boxes' full           replicated boxes (gathered
                                                  gradients, before their          before forward) and their
                                                  reduce-scatter                   full gradients
==================  ============================  ===============================  ==========================

A chunk is ``ceil(numel / p)`` elements of a box replicated on ``p`` ranks (the reducer pads the
last one). A box held by one rank keeps a plain ``.grad`` and is never sharded. ``transient`` is
memory that exists only between the forward and the end of backward; the rest is held across steps. With
the step's program, the transient column narrows to what the runtime keeps at once: in one backward, the two
largest buckets of full gradients (each bucket is reduce-scattered as soon as backward completes it) beside
ZeRO-3's boxes; in a plan cut into stages (ZeRO-3's per-layer default), the most gathered boxes and full
gradients its GATHER / FREE / REDUCE leave alive at once (``gathered_peak``).

Communication is the bytes a rank sends per step, by the ring formulas of ``materialize.AlphaBeta``
for a buffer of ``n`` bytes among ``p`` ranks: all-reduce ``2(p-1)/p·n``; all-gather,
reduce-scatter and all-to-all ``(p-1)/p·n``. Activation collectives count twice (the backward
runs the adjoint collective); point-to-point messages count the activations a rank sends forward
and the gradients it sends back. Gradient reduction: stage 0 all-reduces the replicated boxes;
ZeRO reduce-scatters their padded gradients, and all-gathers the padded boxes once per step
(stage 1 after the optimizer step, stage 3 before the forward: the runtime keeps the gathered box
through backward, so it does not gather it again there). The step's loss is summed over every rank in
one all-reduce, with the sums of the logged values (``logged_values``) in float64 when there are some.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_nnscaler.ir.box import Box
from lightning_nnscaler.ir.tensor import dtype_bytes
from lightning_nnscaler.materialize.kept import KeptBytes, backward_seed_bytes
from lightning_nnscaler.materialize.program import Collective, Compute, Program, Recv
from lightning_nnscaler.plans.context import PipelinePlan
from lightning_nnscaler.program import ActionKind
from lightning_nnscaler.program import Program as StepProgram

MEMORY_KEYS = ("parameters", "gradients", "optimizer", "activations", "transient")
"""The memory columns of a row, in bytes; their sum is the rank's estimated peak."""
ROW_KEYS = (*MEMORY_KEYS, "communication", "gradient_communication")
"""Every key of a row: memory, then bytes sent per step (all of it, and the gradient reduction's part)."""
OPTIMIZER_ASSUMPTION = "optimizer state assumes Adam/AdamW: 2 moments per element a rank steps, in the parameter's dtype"
"""The plan does not know the optimizer: what the ``optimizer`` column assumes."""
COMMUNICATION_CONVENTION = (
    "communication: bytes a rank sends per step (ring: all-reduce 2(p-1)/p·n, all-gather/reduce-scatter/all-to-all "
    "(p-1)/p·n; activation collectives forward and backward; point to point: activations and gradients it sends)"
)
"""How the ``communication`` column counts."""
TRANSIENT_NOTE = "transient: ZeRO's full-size boxes (stage 3) and gradients (stages 1, 3) that exist only during forward/backward"
"""What the ``transient`` column holds."""


def explain_rank(
    program: Program, rank: int, pipeline: PipelinePlan | None = None, *, zero_stage: int = 0,
    element_bytes: Mapping[str, int] | None = None, step: StepProgram | None = None,
) -> dict[str, int]:
    """Rank ``rank``'s row: bytes held (``MEMORY_KEYS``) and sent per step (see the module docstring).

    Activations are the tensors autograd saves for backward; under a ``pipeline``, the most that its schedule
    keeps at once (each segment's from its F to its last backward half). ``element_bytes`` maps a
    parameter's graph name to its bytes per element (4 for names it lacks). Under ZeRO with the ``step``
    program, the transient column is: cut into stages (ZeRO-3), the most gathered boxes and full gradients its
    GATHER / FREE / REDUCE keep alive at once; in one backward, the boxes gathered for the step (ZeRO-3) and the two
    largest buckets of full gradients. Without it, every replicated box's full gradient (and box) counts.
    """
    sizes = element_bytes or {}
    boxes = {
        (local.name, local.box): _numel(local.box) * sizes.get(local.name, 4)
        for local in program.ranks[rank].inputs if local.role == "parameter"
    }
    trainable: dict[tuple[str, Box], int] = {}  # box -> how many ranks sum its gradient
    for group in program.gradient_groups:
        if rank in group.ranks:
            trainable[(group.name, group.box)] = len(group.ranks)
    row = dict.fromkeys(ROW_KEYS, 0)
    row["parameters"] = sum(boxes.values())
    row["activations"], row["communication"] = _activations_and_messages(program, rank, pipeline)
    for (name, box), size in boxes.items():
        replicas = trainable.get((name, box), 0)
        if replicas == 0:  # frozen: no gradient, no optimizer state
            continue
        if replicas == 1:
            row["gradients"] += size
            row["optimizer"] += 2 * size
            continue
        chunk = math.ceil(_numel(box) / replicas) * sizes.get(name, 4)
        _add_replicated(row, zero_stage, size, chunk, replicas)
    if zero_stage == 3 and step is not None and pipeline is not None:
        row["transient"] = gathered_peak(step, rank)
        row["gradient_communication"] += _gathers_again(step, rank)
    elif zero_stage and step is not None:  # one backward: each bucket is reduce-scattered once its gradients are complete
        gathered = sum(size for (name, box), size in boxes.items() if trainable.get((name, box), 0) > 1) if zero_stage == 3 else 0
        row["transient"] = gathered + _in_flight_gradients(step, rank)
    row["communication"] += row["gradient_communication"] + _step_sum_bytes(program)
    return row


def _gathers_again(step: StepProgram, rank: int) -> int:
    """Bytes ZeRO-3 sends gathering buckets more than once a step (a stage gathered for its forward, then again
    for its backward); ``_add_replicated`` counts one gather of each."""
    buckets = step.buckets[rank]
    gathers = [buckets[action.bucket] for action in step.actions[rank] if action.kind is ActionKind.GATHER]
    return sum(ring_bytes("all_gather", len(bucket.ranks), bucket.nbytes) for bucket in gathers) - sum(
        ring_bytes("all_gather", len(bucket.ranks), bucket.nbytes) for bucket in buckets
    )


def _in_flight_gradients(step: StepProgram, rank: int) -> int:
    """Full-size gradients alive at once when a single backward reduce-scatters each bucket as soon as backward
    completes it (the runtime's hooks): about the bucket being summed and the next one filling, the two largest."""
    return sum(sorted((bucket.nbytes for bucket in step.buckets[rank]), reverse=True)[:2])


def gathered_peak(step: StepProgram, rank: int) -> int:
    """Most bytes of ZeRO-3's gathered boxes and their full-size gradients alive at once in ``rank``'s step.

    A GATHER makes a bucket's boxes whole and its FREE releases them; a backward of a stage makes the full
    gradients of that stage's buckets (every bucket, when they name no stage), which live until their REDUCE.
    """
    buckets = step.buckets[rank]
    gathered, pending, peak = 0, 0, 0
    waiting = set(range(len(buckets)))  # buckets whose gradients backward has not made yet
    for action in step.actions[rank]:
        if action.kind is ActionKind.GATHER:
            gathered += buckets[action.bucket].nbytes
        elif action.kind is ActionKind.FREE:
            gathered -= buckets[action.bucket].nbytes
        elif action.kind is ActionKind.BACKWARD:
            made = {index for index in waiting if buckets[index].stage in (None, action.stage)}
            pending += sum(buckets[index].nbytes for index in made)
            waiting -= made
        elif action.kind is ActionKind.REDUCE:
            pending -= buckets[action.bucket].nbytes
        peak = max(peak, gathered + pending)
    return peak


def memory_rows(
    program: Program, parameters: Sequence[Any], pipeline: PipelinePlan | None = None, *, zero_stage: int = 0,
    step: StepProgram | None = None,
) -> list[dict[str, int]]:
    """Every rank's ``explain_rank`` row; ``parameters`` are the graph's parameter tensors (their dtypes give the bytes)."""
    element_bytes = {tensor.name: dtype_bytes(tensor.dtype) for tensor in parameters}
    return [
        explain_rank(program, rank, pipeline, zero_stage=zero_stage, element_bytes=element_bytes, step=step)
        for rank in range(program.world_size)
    ]


def _step_sum_bytes(program: Program) -> int:
    """Bytes a rank sends summing the loss (and the logged values' sums) over the world after the step."""
    outputs = {output.name: output.piece.tensor for each in program.ranks for output in each.outputs}
    values = [tensor.numel for name, tensor in outputs.items() if name != program.loss]
    loss = outputs.get(program.loss) if program.loss is not None else None
    buffer = 8 * (1 + sum(values)) if values else (dtype_bytes(loss.dtype) if loss is not None else 0)
    return ring_bytes("all_reduce", program.world_size, buffer)


def _add_replicated(row: dict[str, int], zero_stage: int, size: int, chunk: int, replicas: int) -> None:
    """Add one box of ``size`` bytes whose gradient ``replicas`` ranks sum (ZeRO chunk: ``chunk`` bytes)."""
    if zero_stage == 0:
        row["gradients"] += size  # the gradient is its view of the reducer's bucket: one copy
        row["optimizer"] += 2 * size
        row["gradient_communication"] += 2 * (replicas - 1) * size // replicas
        return
    row["parameters"] += chunk if zero_stage == 1 else chunk - size  # stage 3 frees the box between steps
    row["gradients"] += chunk
    row["optimizer"] += 2 * chunk
    row["transient"] += size if zero_stage == 1 else 2 * size  # full gradients (and, stage 3, the gathered box)
    row["gradient_communication"] += 2 * (replicas - 1) * chunk  # reduce-scatter + all-gather of the padded box


def _activations_and_messages(program: Program, rank: int, pipeline: PipelinePlan | None) -> tuple[int, int]:
    """Activation bytes kept for backward (what autograd saves, ``materialize.kept``; a pipeline's peak) and the
    bytes of activation messages this rank sends."""
    kept: dict[object, int] = {}
    trained = {group.name for group in program.gradient_groups}
    saved = KeptBytes(program.ranks[rank], trained.__contains__)
    sent = 0
    for action in program.ranks[rank].actions:
        saved.follow(action)
        if isinstance(action, Compute):
            kept[action.segment] = kept.get(action.segment, 0) + saved.kept(action)
        elif isinstance(action, Recv) and action.src != rank and action.gradient and _is_floating(action.dtype):
            sent += _numel_of(action.shape) * dtype_bytes(action.dtype)  # the gradient it sends back
        elif isinstance(action, Collective):
            sent += 2 * ring_bytes(action.kind, len(action.ranks), action.bytes_per_device)  # forward and its adjoint
    for receiver, other in enumerate(program.ranks):  # a stage's message to a stage on the same rank stays local
        sent += sum(
            _numel_of(action.shape) * dtype_bytes(action.dtype)
            for action in other.actions if isinstance(action, Recv) and action.src == rank and receiver != rank
        )
    activations = sum(kept.values()) if pipeline is None else _peak_kept(kept, backward_seed_bytes(program, rank), pipeline.actions(rank))
    return activations, sent


def ring_bytes(kind: str, ranks: int, buffer_bytes: int) -> int:
    """Bytes one rank sends in a ring collective ``kind`` over a buffer of ``buffer_bytes``."""
    factor = 2 if kind == "all_reduce" else 1
    return factor * (ranks - 1) * buffer_bytes // ranks


def _peak_kept(kept: dict[object, int], seeds: dict[object, int], actions: Sequence[Any]) -> int:
    """The most activation bytes alive at once when ``actions`` run in order: each segment's ``kept`` from its F
    to its last backward half, and the output gradients that seed its B (``seeds``) while B runs (until W)."""
    release = "W" if any(action.kind.value == "W" for action in actions) else "B"
    alive = peak = 0
    for action in actions:
        segment, kind = (action.stage, action.microbatch), action.kind.value
        if kind == "F":
            alive += kept.get(segment, 0)
        elif kind == "B":
            peak = max(peak, alive + seeds.get(segment, 0))
            alive += seeds.get(segment, 0) if release == "W" else 0
        if kind == release:
            alive -= kept.get(segment, 0) + (seeds.get(segment, 0) if release == "W" else 0)
        peak = max(peak, alive)
    return peak


def _numel(box: Box) -> int:
    return math.prod(stop - start for start, stop in box)


def _numel_of(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _is_floating(dtype: str) -> bool:
    return getattr(torch, dtype, torch.int64).is_floating_point


def explain_table(title: str, rows: Sequence[Mapping[str, int]]) -> str:
    """``title``, a header, one line of human-readable bytes per rank, and the columns' assumptions."""
    columns = {"params": "parameters", "grads": "gradients", "optimizer*": "optimizer", "activations": "activations",
               "transient†": "transient", "comm/step‡": "communication", "grad comm‡": "gradient_communication"}
    lines = [title, f"{'rank':>4} " + " ".join(f"{name:>12}" for name in columns)]
    for rank, row in enumerate(rows):
        lines.append(f"{rank:>4} " + " ".join(f"{human_bytes(row[key]):>12}" for key in columns.values()))
    lines += [f"* {OPTIMIZER_ASSUMPTION}", f"† {TRANSIENT_NOTE}", f"‡ {COMMUNICATION_CONVENTION}"]
    return "\n".join(lines)


def human_bytes(count: float) -> str:
    """``count`` bytes in B, KiB, MiB, ... (one decimal above bytes)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} PiB"
