"""Buffers a step updates by arithmetic (an EMA, a sample counter), updated per data-parallel replica as under ddp.

The plan runs one graph over the whole global batch, so ``self.seen += x.shape[0]`` or
``self.ema.mul_(0.9).add_(0.1 * x.mean())`` would count or average every replica's rows, where each
ddp rank updates its own copy from its own rows (after taking rank 0's copy, ``broadcast_buffers``).
Such an update is taken from the step traced on *one replica's* rows (its numbers are the replica's:
``x.shape[0]`` is a replica's batch) and, after each step, evaluated on each rank with the rows that
rank loaded and the buffers' values before the step. Only updates that read nothing but the batch,
buffers and constants are taken here; BatchNorm's running statistics are the plan's own (split per
replica); an update that reads a parameter stays the plan's (over the global batch) and is named in
a warning.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lightning_nnscaler.capture.trace import needed_ops
from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir.interpret import call_op
from lightning_nnscaler.ir.op import Op


@dataclass
class ReplicaBufferUpdates:
    """How each rank computes its replica's new values of the buffers a step updates by arithmetic."""

    new_values: dict[str, str] = field(default_factory=dict)
    """Buffer state_dict key -> the tensor (of the replica trace) holding its new value."""
    ops: list[Op] = field(default_factory=list)
    """The replica trace's ops those values need, in order."""
    buffer_inputs: dict[str, str] = field(default_factory=dict)
    """Replica trace input name -> the buffer's state_dict key."""
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Every buffer the ops read, by state_dict key -> its shape."""
    user_inputs: dict[str, str] = field(default_factory=dict)
    """Replica trace input name -> the whole graph's input name (the same batch tensor)."""
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    """The replica trace's constants the ops read."""
    left_to_the_plan: list[str] = field(default_factory=list)
    """Buffers whose update reads a parameter: updated by the plan over the global batch."""

    def compute(self, inputs: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The new buffer values by state_dict key, from this rank's batch ``inputs`` (by the whole graph's input
        names) and the buffers' values before the step (by state_dict key)."""
        values = {name: inputs[whole] for name, whole in self.user_inputs.items()}
        values.update({name: buffers[key] for name, key in self.buffer_inputs.items()})
        values.update(self.constants)
        with torch.no_grad():
            for op in self.ops:
                values.update(zip((output.name for output in op.outputs), call_op(op, lambda _, piece: values[piece.name])))
        return {key: values[name] for key, name in self.new_values.items()}


def replica_buffer_updates(whole: Graph, replica: Graph) -> ReplicaBufferUpdates | None:
    """The arithmetic buffer updates of ``replica`` (the step traced on one replica's rows); None when there are none.

    ``whole`` is the same step traced on the whole batch (its batch inputs are named alike, in order).
    """
    producers = {output.name: op for op in replica.ops for output in op.outputs}
    result = ReplicaBufferUpdates(user_inputs={
        mine.name: theirs.name for mine, theirs in zip(replica.user_inputs, whole.user_inputs)
    })
    needed: set[str] = set()
    for buffer, new in replica.buffer_updates.items():
        key = replica.tensors[buffer].state_key
        if "batch_norm" in getattr(producers.get(new), "target", ""):
            continue  # running statistics: split per replica by the plan itself
        ops = needed_ops(replica, [new])
        reads = {piece.name for op in replica.ops if op.name in ops for piece in op.tensor_inputs if piece.name not in producers}
        if any(replica.tensors[name].role == "parameter" for name in reads):
            result.left_to_the_plan.append(key)
            continue
        needed |= ops
        result.new_values[key] = new
        for name in reads:
            tensor = replica.tensors[name]
            if tensor.role == "buffer":
                result.buffer_inputs[name] = tensor.state_key
                result.shapes[tensor.state_key] = tuple(tensor.shape)
            elif tensor.role == "constant":
                result.constants[name] = replica.constant_values[name]
    if not result.new_values and not result.left_to_the_plan:
        return None
    result.ops = [op for op in replica.ops if op.name in needed]
    return result
