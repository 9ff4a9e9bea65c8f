"""What each cut stage keeps for backward, from what autograd saves (``ir.saved``), for the V schedules' memory limit.

Counted as ``materialize.kept`` counts a rank's segments, on the captured graph before it is split: a tensor
requires grad if it is a trainable parameter or a floating output of an op reading one that does; an op
that differentiates keeps the inputs and outputs autograd saves (each storage once per stage, views as
their base; parameters, buffers and constants not counted) and its own buffers (a fused loss's
log-probabilities); one that cannot run on ``meta`` keeps its outputs. The bytes are the whole batch's:
a microbatch keeps its share of each, so the stages compare as their microbatches do.
"""

from __future__ import annotations

from collections import defaultdict

from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir.saved import NOT_ACTIVATIONS, saved_by
from lightning_nnscaler.ir.tensor import FLOATING
from lightning_nnscaler.plans.stage_cuts import StageCut


def stage_saved_bytes(graph: Graph, cut: StageCut, stages: int) -> tuple[int, ...]:
    """Per stage ``0 … stages - 1`` of ``cut``, the bytes its ops keep for backward over the whole batch."""
    grad = {tensor.name for tensor in graph.parameters if tensor.requires_grad}
    root: dict[str, str] = {}
    counted: dict[int, set[str]] = defaultdict(set)
    kept = [0] * stages
    for op in graph.ops:
        pieces = op.tensor_inputs
        requires_grad = [piece.name in grad for piece in pieces]
        if op.no_grad or not any(requires_grad):
            continue
        grad.update(output.name for output in op.outputs if output.tensor.dtype in FLOATING)
        saved = saved_by(op, requires_grad)
        for output, position in saved.aliases if saved is not None else ():
            root[op.outputs[output].name] = root.get(pieces[position].name, pieces[position].name)
        stage = cut.stage_of.get(op.name, -1)
        if not 0 <= stage < stages:
            continue
        keeps = list(op.outputs) if saved is None else [pieces[i] for i in saved.inputs] + [op.outputs[i] for i in saved.outputs]
        for piece in keeps:
            name = root.get(piece.name, piece.name)
            if piece.tensor.role not in NOT_ACTIVATIONS and name not in counted[stage]:
                counted[stage].add(name)
                kept[stage] += piece.nbytes
        kept[stage] += saved.internal_bytes if saved is not None else 0
    return tuple(kept)
