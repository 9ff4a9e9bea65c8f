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

Bytes scale with ``dtype_bytes / 2`` (the paper's figures are for 16-bit activations).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from lightning_nnscaler.materialize.releases import Posted, send_releases
from lightning_nnscaler.schedules import Action, lower, one_f_one_b
from lightning_nnscaler.sim.costs import roofline_seconds
from lightning_nnscaler.sim.specs import HardwareSpec
from lightning_nnscaler.sim.symmetric import StandIn, representative_ranks
from lightning_nnscaler.sim.tasks import Collective, Compute, Recv, Send, Task, WaitCollectives

RECOMPUTE_MODES = ("none", "selective", "full")
OPTIMIZER_STATE_BYTES = 12  # fp32 master weight, momentum, variance per parameter


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """How a dp × tp × pp plan trains: activation ``recompute`` (``RECOMPUTE_MODES``), ``zero1`` (the distributed
    optimizer over dp) and ``sequence_parallel`` (with tp). The defaults are a plain Megatron 1F1B step."""

    recompute: str = "none"
    zero1: bool = False
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute {self.recompute!r} is not one of {RECOMPUTE_MODES}")


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
    """Every rank's tasks for one 1F1B step of ``shape`` over ``dp × tp × pp`` ranks on ``spec``, trained as
    ``recipe`` says (recompute, ZeRO-1, sequence parallelism).

    ``representatives``: one list per stage instead, its replica 0's piece 0's (``sim.symmetric``): list ``i`` is
    stage ``i``'s, its messages go to lists ``i ± 1`` and its collectives are over ``StandIn`` groups of itself
    that stand for its whole tp and dp groups; ``pp`` lists whatever ``dp`` and ``tp``.
    """
    microbatches = shape.global_batch // (dp * shape.microbatch_size)
    schedule = lower(one_f_one_b(pp, microbatches))
    stage_tasks = [_stage_tasks(shape, spec, stage, tp=tp, pp=pp, dp=dp, recipe=recipe) for stage in range(pp)]
    activation = shape.microbatch_size * shape.seq_len * shape.hidden * shape.dtype_bytes
    keys = [[_key(action) for action in column] for column in schedule.actions]
    released = _released_counts(schedule.actions)
    lists: list[list[Task]] = []
    for rank in representative_ranks(tp=tp, pp=pp) if representatives else range(dp * tp * pp):
        replica, rest = divmod(rank, pp * tp)
        stage, piece = divmod(rest, tp)
        tp_group = tuple(range((replica * pp + stage) * tp, (replica * pp + stage + 1) * tp))
        dp_group = tuple((other * pp + stage) * tp + piece for other in range(dp))
        if representatives:
            tp_group, dp_group = StandIn(stage, tp_group), StandIn(stage, dp_group)
        forward_task, backward_task, optimizer, weight_bytes = stage_tasks[stage]
        tp_bytes = 2 * (shape.layers // pp) * activation
        tensor_parallel = ((Collective("reduce_scatter", tp_group, tp_bytes), Collective("all_gather", tp_group, tp_bytes))
                           if recipe.sequence_parallel else (Collective("all_reduce", tp_group, tp_bytes),))
        # a rank's list is its column's schedule with each action's tasks; the few distinct tasks are shared objects
        tasks_of = {"F": (forward_task, *tensor_parallel), "B": (backward_task, *tensor_parallel)}
        for column in {stage - 1, stage + 1} & set(range(pp)):
            peer = column if representatives else (replica * pp + column) * tp + piece
            tasks_of[column, "send"] = (Send(peer, activation),)
            # a receive drops the copies of the messages its sender had taken before sending it (materialize.releases)
            for count in set(released[stage]):
                tasks_of[column, "recv", count] = (Recv(peer, releases=count * activation),)
        tasks = [task for key, count in zip(keys[stage], released[stage], strict=True)
                 for task in tasks_of[(*key, count) if isinstance(key, tuple) and key[1] == "recv" else key]]
        if recipe.zero1:  # reduce-scatter the gradients, update a 1/dp slice, all-gather the updated weights
            tasks += [Collective("reduce_scatter", dp_group, int(weight_bytes), "gradients", blocking=False), WaitCollectives(),
                      optimizer, Collective("all_gather", dp_group, int(weight_bytes), "parameters")]
        else:
            tasks += [Collective("all_reduce", dp_group, int(weight_bytes), "gradients", blocking=False), WaitCollectives(), optimizer]
        lists.append(tasks)
    return lists


def _stage_tasks(
    shape: TransformerShape, spec: HardwareSpec, stage: int, *, tp: int, pp: int, dp: int = 1, recipe: Recipe = Recipe(),
) -> tuple[Compute, Compute, Compute, float]:
    """Stage ``stage``'s forward, backward and optimizer tasks on one of its ``tp`` ranks, and its weight bytes."""
    layers = shape.layers // pp
    b, s, h = shape.microbatch_size, shape.seq_len, shape.hidden
    head = shape.embeddings and stage == pp - 1
    block_flops = layers * (24 * b * s * h * h + 4 * b * s * s * h)
    flops = (block_flops + (2 * b * s * h * shape.vocab if head else 0)) / tp
    weight_bytes = shape.stage_parameters(stage, pp) * shape.dtype_bytes / tp
    forward = roofline_seconds(spec, flops, 2 * weight_bytes, shape.dtype) + layers * 10 * spec.op_overhead_s
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


def _key(action) -> object:
    """Where ``action``'s tasks are in a rank's table: its kind for compute, (peer column, direction) for messages."""
    if action.kind.is_compute:
        return action.kind.value
    return action.peer, "send" if action.kind.is_send else "recv"
