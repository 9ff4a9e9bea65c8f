"""dp × tp × pp transformer plans built from shapes alone (no tracing): GPT-3 175B on 1024 GPUs.

Per layer and microbatch of ``b`` sequences of ``s`` tokens, hidden ``h`` (Narayanan et al. 2021, §5.1):
forward ``24·b·s·h² + 4·b·s²·h`` FLOPs, split over ``tp`` ranks; Megatron's two all-reduces of the
``b·s·h`` activation per layer forward (and two in backward) inside the tp group; a ``b·s·h``
activation between stages; the gradient all-reduce of the rank's ``12·h²`` parameters per layer
(÷ tp) over its dp group after the pipeline flushes. Ranks are laid out as ``hybrid3d`` does:
``rank = (replica · pp + stage) · tp + piece``, so a tp group sits inside a node.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_nnscaler.schedules import lower, one_f_one_b
from lightning_nnscaler.sim.costs import roofline_seconds
from lightning_nnscaler.sim.specs import HardwareSpec
from lightning_nnscaler.sim.tasks import Collective, Compute, Recv, Send, Task, WaitCollectives


@dataclass(frozen=True, kw_only=True)
class TransformerShape:
    """A GPT's shape and batch (defaults: GPT-3 175B, Brown et al. 2020, Table 2.1; Megatron's batch of 1536)."""

    layers: int = 96
    hidden: int = 12288
    seq_len: int = 2048
    vocab: int = 51200
    microbatch_size: int = 1
    global_batch: int = 1536
    dtype: str = "bfloat16"
    dtype_bytes: int = 2


def transformer_task_lists(shape: TransformerShape, spec: HardwareSpec, *, dp: int, tp: int, pp: int) -> list[list[Task]]:
    """Every rank's tasks for one 1F1B step of ``shape`` over ``dp × tp × pp`` ranks on ``spec``."""
    microbatches = shape.global_batch // (dp * shape.microbatch_size)
    layers = shape.layers // pp
    b, s, h = shape.microbatch_size, shape.seq_len, shape.hidden
    flops = layers * (24 * b * s * h * h + 4 * b * s * s * h) / tp
    activation = b * s * h * shape.dtype_bytes
    weight_bytes = layers * 12 * h * h * shape.dtype_bytes / tp
    forward = roofline_seconds(spec, flops, 2 * weight_bytes, shape.dtype) + layers * 10 * spec.op_overhead_s
    kept = layers * 34 * b * s * h * shape.dtype_bytes // tp  # Korthikanti et al. 2022, eq. 2 without the attention scores
    schedule = lower(one_f_one_b(pp, microbatches))
    forward_task = Compute(forward, "forward", activation_bytes=kept)
    backward_task = Compute(2 * forward, "backward", activation_bytes=-kept)
    optimizer = Compute(7 * 2 * weight_bytes / spec.memory_bandwidth, "optimizer")  # fp32 master weights and moments
    keys = [[_key(action) for action in column] for column in schedule.actions]
    lists: list[list[Task]] = []
    for rank in range(dp * tp * pp):
        replica, rest = divmod(rank, pp * tp)
        stage, piece = divmod(rest, tp)
        tp_group = tuple(range((replica * pp + stage) * tp, (replica * pp + stage + 1) * tp))
        dp_group = tuple((other * pp + stage) * tp + piece for other in range(dp))
        tensor_parallel = Collective("all_reduce", tp_group, 2 * layers * activation)
        # a rank's list is its column's schedule with each action's tasks; the few distinct tasks are shared objects
        tasks_of = {"F": (forward_task, tensor_parallel), "B": (backward_task, tensor_parallel)}
        for column in {stage - 1, stage + 1} & set(range(pp)):
            peer = (replica * pp + column) * tp + piece
            tasks_of[column, "send"], tasks_of[column, "recv"] = (Send(peer, activation),), (Recv(peer),)
        tasks = [task for key in keys[stage] for task in tasks_of[key]]
        tasks += [Collective("all_reduce", dp_group, int(weight_bytes), "gradients", blocking=False), WaitCollectives(), optimizer]
        lists.append(tasks)
    return lists


def _key(action) -> object:
    """Where ``action``'s tasks are in a rank's table: its kind for compute, (peer column, direction) for messages."""
    if action.kind.is_compute:
        return action.kind.value
    return action.peer, "send" if action.kind.is_send else "recv"
