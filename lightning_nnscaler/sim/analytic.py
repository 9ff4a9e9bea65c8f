"""dp × tp × pp transformer plans built from shapes alone (no tracing): GPT-3 175B on 1024 GPUs.

Per layer and microbatch of ``b`` sequences of ``s`` tokens, hidden ``h`` (Narayanan et al. 2021, §5.1):
forward ``24·b·s·h² + 4·b·s²·h`` FLOPs, split over ``tp`` ranks; Megatron's two all-reduces of the
``b·s·h`` activation per layer forward (and two in backward) inside the tp group; a ``b·s·h``
activation between stages; the gradient all-reduce of the rank's ``12·h²`` parameters per layer
(÷ tp) over its dp group after the pipeline flushes. Ranks are laid out as ``hybrid3d`` does:
``rank = (replica · pp + stage) · tp + piece``, so a tp group sits inside a node.

What large runs configure (``Recipe``; the defaults none / off / off):

- activation recompute (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", arXiv 2205.05198, Table 2): a layer keeps ``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` bytes at 16 bits
  without recompute; ``selective`` drops the attention term ``5·a·s/(h·t)`` and recomputes the attention core
  in backward (hardware FLOPs ``72·b·s·h²·(1 + s/3h)`` per layer for the model's ``72·b·s·h²·(1 + s/6h)``:
  2.7 % more for GPT-3, their §5); ``full`` keeps only the layer's input ``2·s·b·h`` and repeats the blocks'
  forward in backward (compute ×4/3).
- sequence parallelism (same paper, §4.2.2): with tp, the ``10`` term is split over tp too (``34/t``), the
  kept layer input of full recompute as well (``2·s·b·h/t``, as Megatron checkpoints the sequence-split
  input), and each tp all-reduce becomes a reduce-scatter plus an all-gather of the same buffer (the same
  ring bytes).
- ZeRO-1, the distributed optimizer (Rajbhandari et al. 2020, P_os): each dp rank updates, and keeps the
  fp32 master weights and Adam moments (12 bytes per parameter) of, a 1/dp slice; the gradient all-reduce
  becomes a reduce-scatter before the update and an all-gather of the updated bf16 weights after it.
- interleaved virtual stages (Narayanan et al. 2021, §2.2.2): each of the ``pp`` ranks holds ``v`` chunks of
  ``layers / (pp·v)`` blocks (rank r: chunks r, r + pp, ...), run by ``schedules.interleaved``; the bubble falls
  from ``(pp-1)/m`` to ``(pp-1)/(v·m)`` of the ideal step, for ``v`` times the messages between stages.
- overlapped gradient reduction (Megatron's ``--overlap-grad-reduce``; PyTorch DDP's buckets, Li et al. 2020):
  a chunk's last backward runs as one bucket per block (at most ``GRADIENT_BUCKETS``), each bucket's gradients
  reduced (all-reduce, or reduce-scatter under ZeRO-1) on the communication stream while the next bucket's
  backward computes; without it the reduction starts after the pipeline flushes.
- overlapped tensor-parallel communication (Megatron's ``--tp-comm-overlap``: Transformer Engine splits each
  matmul and the collective it feeds into chunks so one hides the other; Wang et al. 2023, "Overlap Communication
  with Dependent Computation via Decomposition", ASPLOS): a chunk's forward (backward) takes the longer of its
  compute and its tp collectives, priced on the spec's links; without it they run after the compute.

Bytes scale with ``dtype_bytes / 2`` (the paper's figures are for 16-bit activations).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from lightning_nnscaler.materialize.releases import Posted, send_releases
from lightning_nnscaler.schedules import Action, interleaved, lower, one_f_one_b
from lightning_nnscaler.sim.costs import CommModel, roofline_seconds
from lightning_nnscaler.sim.specs import HardwareSpec
from lightning_nnscaler.sim.symmetric import StandIn, representative_ranks
from lightning_nnscaler.sim.tasks import Collective, Compute, Recv, Send, Task, WaitCollectives

RECOMPUTE_MODES = ("none", "selective", "full")
OPTIMIZER_STATE_BYTES = 12  # fp32 master weight, momentum, variance per parameter
OPS_PER_BLOCK = 10
"""Kernels a block's forward launches, each paying the spec's ``op_overhead_s`` (the backward twice as many)."""
GRADIENT_BUCKETS = 8
"""At most this many gradient buckets per chunk under ``overlap_grad_reduce`` (one per block below it)."""


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """How a dp × tp × pp plan trains: activation ``recompute`` (``RECOMPUTE_MODES``), ``zero1`` (the distributed
    optimizer over dp), ``sequence_parallel`` (with tp), ``virtual_stages`` (interleaved 1F1B with that many
    chunks per rank; 1: plain 1F1B), ``overlap_grad_reduce`` (the gradient reduction bucketed into the last
    backward) and ``overlap_tp_comm`` (tp collectives hidden behind the matmuls they feed, as far as the compute
    lasts). The defaults are a plain Megatron 1F1B step."""

    recompute: str = "none"
    zero1: bool = False
    sequence_parallel: bool = False
    virtual_stages: int = 1
    overlap_grad_reduce: bool = False
    overlap_tp_comm: bool = False

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute {self.recompute!r} is not one of {RECOMPUTE_MODES}")
        if self.virtual_stages < 1:
            raise ValueError(f"virtual_stages is {self.virtual_stages}: give 1 (plain 1F1B) or more chunks per rank")


def layer_activation_bytes(shape: TransformerShape, *, tp: int, recipe: Recipe = Recipe()) -> float:
    """Bytes one block keeps per microbatch on one of its ``tp`` ranks until its backward (Korthikanti et al.
    2022, Table 2; scaled by ``dtype_bytes / 2``)."""
    b, s, h, a = shape.microbatch_size, shape.seq_len, shape.hidden, shape.heads
    scale = shape.dtype_bytes / 2
    sp = recipe.sequence_parallel
    if recipe.recompute == "full":
        return 2 * s * b * h / (tp if sp else 1) * scale
    kept = 34 / tp if sp else 10 + 24 / tp
    if recipe.recompute == "none":
        kept += 5 * a * s / (h * tp)
    return s * b * h * kept * scale


@dataclass(frozen=True, kw_only=True)
class TransformerShape:
    """A GPT's shape and batch (defaults: GPT-3 175B, Brown et al. 2020, Table 2.1; Megatron's batch of 1536)."""

    layers: int = 96
    hidden: int = 12288
    seq_len: int = 2048
    vocab: int = 51200
    heads: int = 96
    microbatch_size: int = 1
    global_batch: int = 1536
    dtype: str = "bfloat16"
    dtype_bytes: int = 2
    embeddings: bool = False
    """Count the token embedding (first stage: ``vocab·h`` parameters) and the untied LM head (last stage:
    ``vocab·h`` parameters, ``2·b·s·h·vocab`` forward FLOPs and the ``b·s·vocab`` logits kept, split over tp by
    vocab as Megatron does); off, only the blocks count."""

    def stage_parameters(self, stage: int, pp: int) -> int:
        """Parameters of pipeline stage ``stage`` of ``pp`` (before the tp split): ``12·h²`` per block, and the
        embedding / head rows when ``embeddings``."""
        table = self.vocab * self.hidden if self.embeddings else 0
        return self.layers // pp * 12 * self.hidden**2 + table * ((stage == 0) + (stage == pp - 1))


def transformer_task_lists(
    shape: TransformerShape, spec: HardwareSpec, *, dp: int, tp: int, pp: int, representatives: bool = False,
    recipe: Recipe = Recipe(),
) -> list[list[Task]]:
    """Every rank's tasks for one 1F1B step (interleaved with ``recipe.virtual_stages`` > 1) of ``shape`` over
    ``dp × tp × pp`` ranks on ``spec``, trained as ``recipe`` says (recompute, ZeRO-1, sequence parallelism,
    overlapped gradient reduction).

    ``representatives``: one list per stage instead, its replica 0's piece 0's (``sim.symmetric``): list ``i`` is
    stage ``i``'s, its messages go to the lists of the stages beside it and its collectives are over ``StandIn``
    groups of itself that stand for its whole tp and dp groups; ``pp`` lists whatever ``dp`` and ``tp``.
    """
    chunks = pp * recipe.virtual_stages
    microbatches = shape.global_batch // (dp * shape.microbatch_size)
    compute = interleaved(pp, recipe.virtual_stages, microbatches) if recipe.virtual_stages > 1 else one_f_one_b(pp, microbatches)
    schedule = lower(compute)
    chunk_tasks = [_stage_tasks(shape, spec, chunk, tp=tp, pp=chunks, dp=dp, recipe=recipe) for chunk in range(chunks)]
    activation = shape.microbatch_size * shape.seq_len * shape.hidden * shape.dtype_bytes
    keys = [[_key(action) for action in column] for column in schedule.actions]
    released = _released_counts(schedule.actions)
    peers = [sorted({action.peer for action in column if not action.kind.is_compute}) for column in schedule.actions]
    # a large-run spec's per-message hold on both ends (large_run.LargeRunSpec.message_overhead_s; none elsewhere)
    held = getattr(spec, "message_overhead_s", 0.0)
    overhead = (Compute(held, "forward", "stage message"),) if held else ()
    lists: list[list[Task]] = []
    for rank in representative_ranks(tp=tp, pp=pp) if representatives else range(dp * tp * pp):
        replica, rest = divmod(rank, pp * tp)
        stage, piece = divmod(rest, tp)
        tp_group = tuple(range((replica * pp + stage) * tp, (replica * pp + stage + 1) * tp))
        dp_group = tuple((other * pp + stage) * tp + piece for other in range(dp))
        if representatives:
            tp_group, dp_group = StandIn(stage, tp_group), StandIn(stage, dp_group)
        mine = [chunk_tasks[chunk] for chunk in range(stage, chunks, pp)]
        tasks_of = _compute_table(shape, spec, recipe, mine, (stage, pp), tp_group, dp_group)
        for column in peers[stage]:
            peer = column if representatives else (replica * pp + column) * tp + piece
            tasks_of[column, "send"] = (Send(peer, activation), *overhead)
            # a receive drops the copies of the messages its sender had taken before sending it (materialize.releases)
            for count in set(released[stage]):
                tasks_of[column, "recv", count] = (Recv(peer, releases=count * activation), *overhead)
        last_backwards = set({key: index for index, key in enumerate(keys[stage]) if key[0] == "B"}.values())  # per chunk
        tasks = [task for index, (key, count) in enumerate(zip(keys[stage], released[stage], strict=True))
                 for task in tasks_of[(*key, count) if key[1] == "recv" else
                                      (*key, "last") if recipe.overlap_grad_reduce and index in last_backwards else key]]
        head, tail = _weight_exchange(recipe, mine, dp_group)
        lists.append(head + tasks + tail)
    return lists


def _compute_table(
    shape: TransformerShape, spec: HardwareSpec, recipe: Recipe, mine: Sequence[tuple[Compute, Compute, Compute, float]],
    place: tuple[int, int], tp_group: tuple[int, ...], dp_group: tuple[int, ...],
) -> dict[object, tuple[Task, ...]]:
    """A rank's compute tasks by key (``place``: its stage and the pipeline's ranks): ``("F", chunk)`` and
    ``("B", chunk)`` with their tp collectives (Megatron's two per block each way; under ``overlap_tp_comm`` folded
    into the compute), and under ``overlap_grad_reduce`` ``("B", chunk, "last")``: the chunk's last backward as
    buckets, each followed by the non-blocking reduction of its gradients over ``dp_group``."""
    stage, pp = place
    activation = shape.microbatch_size * shape.seq_len * shape.hidden * shape.dtype_bytes
    tp_bytes = 2 * (shape.layers // (pp * recipe.virtual_stages)) * activation
    tensor_parallel = ((Collective("reduce_scatter", tp_group, tp_bytes), Collective("all_gather", tp_group, tp_bytes))
                       if recipe.sequence_parallel else (Collective("all_reduce", tp_group, tp_bytes),))
    if recipe.overlap_tp_comm and len(getattr(tp_group, "whole", tp_group)) > 1:
        comm, whole = CommModel(spec), getattr(tp_group, "whole", tp_group)
        hidden = sum(comm.collective_seconds(task.kind, whole, task.nbytes) for task in tensor_parallel)
        mine = [(forward._replace(seconds=max(forward.seconds, hidden)), backward._replace(seconds=max(backward.seconds, hidden)),
                 optimizer, weight_bytes) for forward, backward, optimizer, weight_bytes in mine]
        tensor_parallel = ()
    table: dict[object, tuple[Task, ...]] = {}
    for index, (forward, backward, _, weight_bytes) in enumerate(mine):
        chunk = stage + index * pp
        table["F", chunk] = (forward, *tensor_parallel)
        table["B", chunk] = (backward, *tensor_parallel)
        if recipe.overlap_grad_reduce:
            buckets = max(1, min(GRADIENT_BUCKETS, shape.layers // (pp * recipe.virtual_stages)))
            kind = "reduce_scatter" if recipe.zero1 else "all_reduce"
            piece = Compute(backward.seconds / buckets, "backward", activation_bytes=backward.activation_bytes // buckets,
                            transient_bytes=backward.transient_bytes)
            rest = backward.activation_bytes - (buckets - 1) * piece.activation_bytes
            reduce = Collective(kind, dp_group, int(weight_bytes / buckets), "gradients", blocking=False)
            table["B", chunk, "last"] = (*[piece, reduce] * (buckets - 1), piece._replace(activation_bytes=rest), reduce,
                                         *tensor_parallel)
    return table


def _weight_exchange(
    recipe: Recipe, mine: Sequence[tuple[Compute, Compute, Compute, float]], dp_group: tuple[int, ...],
) -> tuple[list[Task], list[Task]]:
    """What a rank runs before its first forward and after its last backward: the gradient reduction over
    ``dp_group`` (unless the backward already posted it), the optimizer's update and, under ZeRO-1, the all-gather
    of the updated weights: after the update, or under ``overlap_grad_reduce`` (with Megatron's
    ``--overlap-param-gather``) posted at the step's start, the previous update's gather under this step's forwards."""
    weight_bytes = sum(chunk[3] for chunk in mine)
    optimizer = mine[0][2] if len(mine) == 1 else Compute(sum(chunk[2].seconds for chunk in mine), "optimizer")
    kind = "reduce_scatter" if recipe.zero1 else "all_reduce"
    reduce = [] if recipe.overlap_grad_reduce else [Collective(kind, dp_group, int(weight_bytes), "gradients", blocking=False)]
    if not recipe.zero1:
        return [], [*reduce, WaitCollectives(), optimizer]
    if recipe.overlap_grad_reduce:
        return [Collective("all_gather", dp_group, int(weight_bytes), "parameters", blocking=False)], [WaitCollectives(), optimizer]
    return [], [*reduce, WaitCollectives(), optimizer, Collective("all_gather", dp_group, int(weight_bytes), "parameters")]


def _stage_tasks(
    shape: TransformerShape, spec: HardwareSpec, stage: int, *, tp: int, pp: int, dp: int = 1, recipe: Recipe = Recipe(),
) -> tuple[Compute, Compute, Compute, float]:
    """Stage ``stage``'s forward, backward and optimizer tasks on one of its ``tp`` ranks, and its weight bytes."""
    layers = shape.layers // pp  # pp: the pipeline's chunks (virtual stages) here
    b, s, h = shape.microbatch_size, shape.seq_len, shape.hidden
    head = shape.embeddings and stage == pp - 1
    block_flops = layers * (24 * b * s * h * h + 4 * b * s * s * h)
    flops = (block_flops + (2 * b * s * h * shape.vocab if head else 0)) / tp
    weight_bytes = shape.stage_parameters(stage, pp) * shape.dtype_bytes / tp
    forward = (roofline_seconds(spec, flops, 2 * weight_bytes, shape.dtype) + _elementwise_seconds(shape, spec, layers, tp, recipe)
               + layers * OPS_PER_BLOCK * spec.op_overhead_s)
    # recomputed in backward, at the forward's rate: the blocks' forward (full), or the attention core, which
    # Korthikanti et al. count as 72·b·s·h²·s/6h = 12·b·s²·h FLOPs per layer (selective)
    recomputed = {"none": 0.0, "selective": layers * 12 * b * s * s * h / tp, "full": block_flops / tp}[recipe.recompute]
    backward = 2 * forward + (forward * recomputed / flops if recomputed else 0.0)
    kept = int(layers * layer_activation_bytes(shape, tp=tp, recipe=recipe))
    kept += b * s * shape.vocab * shape.dtype_bytes // tp if head else 0  # the logits, for the softmax's backward
    # what a recomputing backward holds above the kept bytes while one block's backward runs: what it recomputed
    plain = layer_activation_bytes(shape, tp=tp, recipe=replace(recipe, recompute="none"))
    transient = 0 if recipe.recompute == "none" else int(plain - layer_activation_bytes(shape, tp=tp, recipe=recipe))
    # fp32 master weights and moments read and written: the rank's 1/dp slice under ZeRO-1
    optimizer = Compute(7 * 2 * weight_bytes / spec.memory_bandwidth / (dp if recipe.zero1 else 1), "optimizer")
    return (Compute(forward, "forward", activation_bytes=kept),
            Compute(backward, "backward", activation_bytes=-kept, transient_bytes=transient), optimizer, weight_bytes)


def _elementwise_seconds(shape: TransformerShape, spec: HardwareSpec, layers: int, tp: int, recipe: Recipe) -> float:
    """The memory-bound kernels of ``layers`` blocks' forward on one tp rank, on a spec with large-run terms
    (``large_run.LargeRunSpec.activation_traffic``; 0 on others): that many passes over the bytes a block keeps
    without recompute (with selective recompute, as with flash attention, no attention scores), at the spec's
    memory bandwidth × ``memory_efficiency``."""
    passes = getattr(spec, "activation_traffic", 0.0)
    if not passes:
        return 0.0
    kept = "selective" if recipe.recompute == "selective" else "none"
    written = layer_activation_bytes(shape, tp=tp, recipe=replace(recipe, recompute=kept))
    return passes * layers * written / (spec.memory_bandwidth * spec.memory_efficiency)


def _released_counts(columns: Sequence[Sequence[Action]]) -> list[list[int]]:
    """Per column and action: how many of the column's sent messages a receive proves taken (0 for other actions)."""
    sequences, sent, received = [], {}, {}
    for column, actions in enumerate(columns):
        posts = []
        for action in actions:
            if action.kind.is_compute:
                continue
            pair = (column, action.peer) if action.kind.is_send else (action.peer, column)
            counter = sent if action.kind.is_send else received
            counter[pair] = counter.get(pair, 0) + 1
            posts.append(Posted("send" if action.kind.is_send else "recv", action.peer, (*pair, counter[pair])))
        sequences.append(posts)
    releases = send_releases(sequences)
    counts = []
    for column, (actions, posts) in enumerate(zip(columns, sequences, strict=True)):
        received_messages = iter(post.message for post in posts if post.kind == "recv")
        counts.append([0 if action.kind.is_compute or action.kind.is_send else len(releases[column].get(next(received_messages), ()))
                       for action in actions])
    return counts


def _key(action: Action) -> tuple:
    """Where ``action``'s tasks are in a rank's table: (kind, chunk) for compute, (peer column, direction) for messages."""
    if action.kind.is_compute:
        return action.kind.value, action.stage
    return action.peer, "send" if action.kind.is_send else "recv"
