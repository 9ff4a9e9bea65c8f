"""Memory a rank holds only while a segment computes, beyond the activations kept for backward.

An allocator's peak is not the kept activations alone (``materialize.kept``): in the forward, an op's
output lives from the op until its last reader even when autograd keeps nothing of it (a loss's logits,
read once by the log-softmax); in the backward, the gradient of each activation lives from the backward
of its first consumer to that of its producer, and a trainable parameter's gradient is a fresh tensor
until it is added to ``.grad`` (or the reducer's bucket). ``TransientBytes`` follows a rank's program in
order for the forward side and walks a segment's ops in reverse for the backward side, by storage (an
output that views an input, as ``materialize.kept`` finds them, is no new memory; its gradient is a view
of the output's). What an op allocates inside its kernels is not counted.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field

from lightning_nnscaler.ir.tensor import FLOATING, VTensor, dtype_bytes
from lightning_nnscaler.materialize.kept import KeptBytes
from lightning_nnscaler.materialize.program import Compute, RankProgram, reads, writes


@dataclass(frozen=True)
class OpMemory:
    """What one op's backward touches: its kept bytes, the gradients it makes (by input variable: bytes,
    whether a trainable parameter's, whether a view of an output's gradient; an input that slices a held
    parameter piece, as a co-shard does, is that piece, whose whole gradient the slice's backward makes), the outputs it consumes, and
    the gradients of its internal saved tensors (a fused loss's log-probabilities), alive only inside it."""

    kept: int
    input_grads: tuple[tuple[str, int, bool, bool], ...]
    outputs: tuple[str, ...]
    internal: int = 0
    fed: bool = False
    """Whether an output gets its gradient from outside the rank's ops (it is sent, gathered, assembled, or the
    seeded loss); else the op's backward runs only if a later op's backward made one of its outputs' gradients."""


@dataclass
class TransientBytes:
    """Follow a rank's actions in order: ``follow`` each (a compute after ``KeptBytes.kept`` has seen it, so its
    outputs' views are known), then ``forward_bytes`` and ``op_memory`` for a compute."""

    program: RankProgram
    kept: KeptBytes
    last_read: dict[str, int] = field(default_factory=dict)
    index: int = -1
    _end: dict[str, int] = field(default_factory=dict)
    _unkept: dict[Hashable, dict[str, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        actions = self.program.actions
        end = len(actions)
        for position, action in enumerate(actions):
            for var in reads(action):
                self.last_read[var] = position
        for output in self.program.outputs:
            self.last_read[output.var] = end
        self._held = {local.var for local in self.program.inputs}
        self._boxes = {local.var: local.box for local in self.program.inputs}
        self._fed = {var for action in actions if not isinstance(action, Compute) for var in reads(action)}
        self._fed |= {output.var for output in self.program.outputs if output.seed}

    def follow(self, action: object) -> None:
        """Advance to ``action``: free the unkept storages whose last reader has run, add what it writes."""
        self.index += 1
        for unkept in self._unkept.values():
            for root in [root for root in unkept if self._end.get(root, -1) < self.index]:
                del unkept[root]
        segment = getattr(action, "segment", None)
        for var in writes(action):
            root = self.kept.root(var)
            self._end[root] = max(self._end.get(root, -1), self.last_read.get(var, self.index))
            if root != var or root in self._held or root in self.kept.uncounted:
                continue
            self._unkept.setdefault(segment, {})[root] = 0  # sized in forward_bytes, once KeptBytes knows it

    def forward_bytes(self, action: Compute) -> int:
        """Bytes of ``action``'s segment's live storages that nothing keeps for backward, as the op runs."""
        counted = self.kept.counted.get(action.segment, set())
        unkept = self._unkept.get(action.segment, {})
        total = 0
        for root in list(unkept):
            if root in counted:
                del unkept[root]
                continue
            if not unkept[root]:
                unkept[root] = self.kept.nbytes.get(root, 0)
            total += unkept[root]
        return total

    def op_memory(self, action: Compute, kept_bytes: int) -> OpMemory:
        """What ``action``'s backward touches (call after ``KeptBytes.kept(action)``)."""
        op = action.op
        output_roots = {self.kept.root(var) for var in action.output_vars}
        grads = []
        if not op.no_grad:
            for var, piece in zip(action.input_vars, op.tensor_inputs):
                if var not in self.kept.grad or piece.tensor.dtype not in FLOATING:
                    continue
                root = self.kept.root(var)
                if root in self.kept.uncounted:  # a parameter piece, or a slice of one (co-shard): its whole gradient is made
                    grads.append((root, self._parameter_bytes(root, piece), True, False))
                    continue
                grads.append((var, self.kept.nbytes.get(var, 0), False, root in output_roots))
        internal = self.kept.internal.get(op.name, 0) if grads else 0
        fed = any(var in self._fed for var in action.output_vars)
        return OpMemory(kept_bytes, tuple(grads), tuple(action.output_vars), internal, fed)


    def _parameter_bytes(self, var: str, piece: VTensor) -> int:
        """Bytes of the held parameter piece ``var`` (of ``piece``'s dtype), which an op may read a slice of."""
        if var in self.kept.nbytes:
            return self.kept.nbytes[var]
        box = self._boxes[var]
        return math.prod(stop - start for start, stop in box) * dtype_bytes(piece.tensor.dtype)


def backward_peaks(chunks: list[list[OpMemory]]) -> list[int]:
    """For one segment's chunks in forward order: per chunk, the most bytes its backward holds beyond what was
    live when it began (its kept activations still counted): the gradients alive at each op, less the kept
    bytes already freed in the chunk. Gradients of a later chunk's inputs carry into the earlier chunk. An op
    runs backward when one of its outputs is ``fed`` or has a gradient made by a later op."""
    live: dict[str, int] = {}
    peaks = [0] * len(chunks)
    for position in reversed(range(len(chunks))):
        freed = peak = 0
        for op in reversed(chunks[position]):
            if not op.fed and not any(var in live for var in op.outputs):
                continue  # no gradient reaches it (a replica's copy of the loss that another rank seeds): its saved tensors wait for the step's end
            fresh = op.internal
            for var, nbytes, parameter, view in op.input_grads:
                if parameter:
                    fresh += nbytes  # added to .grad right after
                elif view:
                    continue
                elif var in live:
                    fresh += nbytes  # summed with the gradient already there
                else:
                    live[var] = nbytes
            peak = max(peak, sum(live.values()) + fresh - freed)
            for var in op.outputs:
                live.pop(var, None)
            for var, nbytes, parameter, view in op.input_grads:
                if view and not parameter:
                    live.setdefault(var, nbytes)
            freed += op.kept
        peaks[position] = max(peak, 0)
    return peaks
