"""Activation bytes a rank keeps for backward, op by op, from what autograd saves (``ir.saved``).

A rank's variables are followed through its actions: which require grad (trainable parameter
pieces, and whatever a differentiable op, collective or assembly makes of them; floating boundary
receives), and which are views of another (an op's output that ``saved_by`` found sharing an input's
storage, a single-slice assembly). Each op adds to its segment the bytes of the saved variables'
roots not yet counted there, plus its own buffers; parameter, buffer and constant pieces are not
counted (the measurement, ``sim.meter``, excludes them). ``explain`` and the simulator both count with it. No-grad ops keep nothing, recomputed ones their block's inputs from outside it
(a recompute group is checkpointed in contiguous blocks, cut where an action outside the group reads a
member's output, as ``codegen.recompute`` cuts it); an op that cannot run on ``meta`` keeps all its outputs (counted in ``fallbacks``).

A pipeline segment's backward (B) also holds the gradients of the tensors the segment sent
(``backward_seed_bytes``): the runtime seeds backward with their product with those tensors, which
autograd saves until B is done (under zero-bubble schedules, until W).
"""

from __future__ import annotations

import math
from typing import Callable, Hashable

from lightning_nnscaler.ir.saved import NOT_ACTIVATIONS, saved_by
from lightning_nnscaler.ir.tensor import FLOATING, dtype_bytes
from lightning_nnscaler.materialize.program import Action, Assemble, Collective, Compute, Program, Recv, RankProgram, Segment, Send, reads


class KeptBytes:
    """One rank's kept activation bytes; call ``follow`` on each action in program order, ``kept`` on computes."""

    def __init__(self, program: RankProgram, trains: Callable[[str], bool]) -> None:
        self.uncounted = {local.var for local in program.inputs if local.role in NOT_ACTIVATIONS}
        self.grad = {local.var for local in program.inputs if local.role == "parameter" and trains(local.name)}
        self.roots: dict[str, str] = {}
        self.nbytes: dict[str, int] = {}
        self.counted: dict[Hashable, set[str]] = {}
        self.block_of: dict[str, tuple[int, int]] = {}
        """``(recompute group, block)`` of the recomputed op that wrote each variable."""
        self.current_block: dict[int, int] = {}
        """Per recompute group, the block its next member joins."""
        self.fallbacks = 0
        """Ops whose saved tensors could not be measured (all their outputs counted)."""
        self.internal: dict[str, int] = {}
        """By op name: bytes of the tensors it saves that are neither its inputs nor its outputs (a fused loss's log-probabilities)."""

    def root(self, var: str) -> str:
        """The variable whose storage ``var`` views (``var`` itself when it owns one)."""
        return self.roots.get(var, var)

    def follow(self, action: Action) -> None:
        """Carry requires-grad and views through a communication or assembly action; end the recompute blocks it reads."""
        self._end_blocks_read_by(action)
        if isinstance(action, Assemble) and not action.zeros:
            if any(fragment.var in self.grad for fragment in action.fragments):
                self.grad.add(action.var)
            if len(action.fragments) == 1 and all(
                region.start in (0, None) and region.stop == size for region, size in zip(action.fragments[0].target_region, action.piece.shape)
            ):
                self.roots[action.var] = self.root(action.fragments[0].var)
        elif isinstance(action, Collective) and action.source_var in self.grad:
            self.grad.add(action.var)
        elif isinstance(action, Recv) and action.dtype in FLOATING and action.gradient:
            self.grad.add(action.var)

    def kept(self, action: Compute) -> int:
        """Bytes ``action``'s op adds to its segment's kept activations (0 for no-grad ops; for a recomputed op,
        its inputs from outside its recompute group, which the checkpoint keeps to run the group again)."""
        op = action.op
        pieces = op.tensor_inputs
        for var, piece in zip(action.input_vars, pieces):
            self.nbytes.setdefault(var, piece.nbytes)
        for var, piece in zip(action.output_vars, op.outputs):
            self.nbytes.setdefault(var, piece.nbytes)
            if op.recompute is None:
                self.block_of.pop(var, None)
            else:
                self.block_of[var] = (op.recompute, self.current_block.setdefault(op.recompute, 0))
        requires_grad = [var in self.grad for var in action.input_vars]
        if op.no_grad:
            return 0
        if any(requires_grad):
            self.grad.update(var for var, piece in zip(action.output_vars, op.outputs) if piece.tensor.dtype in FLOATING)
        else:
            return 0  # nothing to differentiate: autograd saves nothing
        saved = saved_by(op, requires_grad)
        if saved is not None:
            for output, position in saved.aliases:
                self.roots[action.output_vars[output]] = self.root(action.input_vars[position])
        if op.recompute is not None:
            block = (op.recompute, self.current_block[op.recompute])
            block_inputs = [var for var in action.input_vars if self.block_of.get(var) != block]
            return self._count(action.segment, block_inputs)
        if saved is None:
            self.fallbacks += 1
            return self._count(action.segment, action.output_vars)
        variables = [action.input_vars[position] for position in saved.inputs] + [action.output_vars[position] for position in saved.outputs]
        self.internal[action.op.name] = saved.internal_bytes
        return self._count(action.segment, variables) + saved.internal_bytes

    def _end_blocks_read_by(self, action: Action) -> None:
        """A recompute block ends where an action outside its group reads one of its outputs."""
        if not isinstance(action, (Compute, Send, Assemble, Collective)):
            return
        group = action.op.recompute if isinstance(action, Compute) else None
        for var in reads(action):
            written = self.block_of.get(var)
            if written is not None and written[0] != group and written[1] == self.current_block[written[0]]:
                self.current_block[written[0]] += 1

    def _count(self, segment: Hashable, variables: list[str]) -> int:
        counted = self.counted.setdefault(segment, set())
        total = 0
        for var in variables:
            root = self.root(var)
            if root in self.uncounted or root in counted:
                continue
            counted.add(root)
            total += self.nbytes.get(root, self.nbytes[var])
        return total


def backward_seed_bytes(program: Program, rank: int) -> dict[Segment, int]:
    """Per segment of ``rank``: the bytes of the gradients its B receives for the boundary tensors it sent."""
    received = {
        (action.src, other.rank, action.tag): math.prod(action.shape) * dtype_bytes(action.dtype)
        for other in program.ranks for action in other.actions if isinstance(action, Recv) and action.boundary
    }
    seeds: dict[Segment, int] = {}
    for action in program.ranks[rank].actions:
        if isinstance(action, Send) and action.boundary and action.gradient:
            seeds[action.segment] = seeds.get(action.segment, 0) + received.get((rank, action.dst, action.tag), 0)
    return seeds
