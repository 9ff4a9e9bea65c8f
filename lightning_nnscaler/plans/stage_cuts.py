"""Stage cuts: which ops of a graph each pipeline stage holds (the op_assign of contiguous op ranges).

The graph's ops are cut into stages of about equal cost, each cut placed where the fewest activation bytes
cross it (between blocks: the residual stream), or by layers per stage. The cost of an op is estimated from
its shapes (FLOPs of linears, matmuls and attention; elements moved elsewhere), or given by the caller:
``OpPrices``, each op's measured forward and backward seconds (``balance="measured"``). Ops that read no activation (a weight's
transpose, position embeddings) join the stage of their first reader; ops that need no gradient and
read only the batch and constants (a loss's count of kept targets, masks) form the step's prologue.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir.op import PROLOGUE, Op
from lightning_nnscaler.ir.work import op_work

PROLOGUE_STAGE = PROLOGUE[0]
OpPrices = Callable[[Sequence[Op]], Sequence[float]]
"""Each op's cost (seconds of its forward and backward), the same on every rank: what a stage cut balances."""


@dataclass(frozen=True)
class StageCut:
    """Each op of the captured graph -> its stage (``PROLOGUE_STAGE`` for the prologue), and who reads it."""

    stage_of: dict[str, int]
    readers: dict[str, list[str]]
    work: tuple[tuple[int, float], ...] = ()
    """``(stage, cost)`` of each cut stage: the prices it was cut by (the estimate where it was cut by layers)."""

    def first_reader_stage(self, name: str) -> int:
        """Where the prologue op ``name`` runs: the first stage that reads its outputs, through prologue ops.

        An op no stage reads (a logged value computed from the batch: a loss's count of kept targets per
        replica) runs with the prologue op that feeds it, so that the batch columns it shares with a
        stage's op (the targets of the loss) are read on one rank rather than sent to it; with none, stage 0.
        """
        if name not in self._placed:  # asked once per piece of each op: remembered
            stage = self._reading_stage(name)
            if stage is None:
                feeding = [feed for feed in self._feeds.get(name, []) if self.stage_of[feed] == PROLOGUE_STAGE]
                stage = min((self.first_reader_stage(feed) for feed in feeding), default=0)
            self._placed[name] = stage
        return self._placed[name]

    def _reading_stage(self, name: str) -> int | None:
        """The first stage that reads ``name``'s outputs, through prologue ops; None when no stage does."""
        stages = [self.stage_of[reader] if self.stage_of[reader] != PROLOGUE_STAGE else self._reading_stage(reader)
                  for reader in self.readers.get(name, [])]
        return min((stage for stage in stages if stage is not None), default=None)

    @functools.cached_property
    def _placed(self) -> dict[str, int]:
        """``first_reader_stage``'s answers so far."""
        return {}

    @functools.cached_property
    def _feeds(self) -> dict[str, list[str]]:
        """Op name -> the ops whose outputs it reads (``readers`` inverted)."""
        feeds: dict[str, list[str]] = {}
        for producer, readers in self.readers.items():
            for reader in readers:
                feeds.setdefault(reader, []).append(producer)
        return feeds


def cut_stages(
    graph: Graph, stages: int, forward_only: int = 0, fixed: dict[str, int] | None = None, first: int = 0,
    layers_per_stage: Sequence[int] | None = None, prices: OpPrices | None = None,
) -> StageCut:
    """Each op of ``graph`` (not yet split) -> its stage (``PROLOGUE_STAGE`` for the prologue).

    With ``layers_per_stage``, stage ``s`` holds the next ``layers_per_stage[s]`` of the model's layers
    (``model_layers``) instead of an equal share of the cost.

    The ops of ``fixed`` keep their given stage; the other ops on the batch's path are cut into
    ``stages`` stages numbered from ``first`` (the interlaced pipeline's shared layers are fixed), of about
    equal ``prices`` (default: ``op_cost``, estimated from shapes).

    With ``forward_only`` > 0 (3F1B), the ops running under ``no_grad`` (the recycling passes, which
    must all come before the gradient pass) fill the first ``forward_only`` stages, the others the rest.

    Raises:
        ValueError: when the graph has fewer ops that read activations than ``stages``, or no-grad ops
            after gradient ones with ``forward_only``.
    """
    ops = list(graph.ops)
    producer = {output.name: op for op in ops for output in op.outputs}
    readers: dict[str, list[str]] = {}
    for op in ops:
        for piece in op.tensor_inputs:
            if piece.name in producer:
                readers.setdefault(producer[piece.name].name, []).append(op.name)
    kind = op_kinds(graph, ops, producer)
    fixed = fixed or {}
    flowing = [op for op in ops if kind[op.name] == "batch" and op.name not in fixed]
    if len(flowing) < stages:
        raise ValueError(f"pipeline: {stages} stages need at least {stages} ops on the batch's path; the model has {len(flowing)}")
    stage_of: dict[str, int] = {}
    if forward_only:
        flows = _gradient_flows(graph, ops, producer)
        first = next((index for index, op in enumerate(flowing) if flows[op.name]), len(flowing))
        recycling, gradient = flowing[:first], flowing[first:]  # the recycling passes and what hands their state on
        if len(recycling) < forward_only or len(gradient) < stages - forward_only:
            raise ValueError(f"3f1b: {len(recycling)} recycling and {len(gradient)} gradient-pass ops cannot fill {forward_only} and {stages - forward_only} stages")
        parts = [(recycling, forward_only, 0), (gradient, stages - forward_only, forward_only)]
    else:
        parts = [(flowing, stages, first)]
    work: dict[int, float] = {}
    for part, count, start in parts:
        costs = list(prices(part)) if prices is not None and layers_per_stage is None else [op_cost(op) for op in part]
        cuts = _layer_cuts(graph, part, count, layers_per_stage) if layers_per_stage is not None else _balanced_cuts(part, count, costs)
        for index, (op, cost) in enumerate(zip(part, costs, strict=True)):
            stage_of[op.name] = start + sum(index >= cut for cut in cuts)
            work[stage_of[op.name]] = work.get(stage_of[op.name], 0.0) + cost
    stage_of.update(fixed)
    for op in reversed(ops):  # weights-only ops join their first reader's stage
        if kind[op.name] == "weights":
            stage_of[op.name] = min((stage_of[reader] for reader in readers.get(op.name, []) if stage_of.get(reader, -1) >= 0), default=0)
        elif kind[op.name] == "prologue":
            stage_of[op.name] = PROLOGUE_STAGE
    return StageCut(stage_of, readers, tuple((stage, work.get(stage, 0.0)) for stage in range(first, first + stages)))


_LAYER = re.compile(r"^(.*\.\d+)\.")


def model_layers(graph: Graph, ops: Sequence[Op]) -> tuple[list[int], int]:
    """Per op of ``ops`` (in order), the index of the layer it belongs to; and how many layers there are.

    A layer is a numbered module (``blocks.3``, ``encoder.layers.0``): the longest prefix of a parameter's
    ``state_dict`` key that ends in a number. An op reading such a parameter belongs to its layer; an op
    reading none (a residual add, an activation) to the layer of the op before it. The embeddings
    before the first layer are layer -1; the head after the last layer (from the first op reading a
    parameter there: a final norm, an LM head) is layer ``count``, so a stage of 0 layers at either end
    holds only the embeddings or the head.
    """
    index_of: dict[str, int] = {}
    layers, current, last_numbered = [], -1, -1
    reads_parameters = []
    for position, op in enumerate(ops):
        keys = [graph.tensors[piece.name].state_key or "" for piece in op.tensor_inputs if graph.tensors[piece.name].role == "parameter"]
        numbered = [match.group(1) for match in map(_LAYER.match, keys) if match]
        if numbered:
            current, last_numbered = index_of.setdefault(numbered[0], len(index_of)), position
        layers.append(current)
        reads_parameters.append(bool(keys))
    head = next((position for position in range(last_numbered + 1, len(ops)) if reads_parameters[position]), None)
    if head is not None:
        layers[head:] = [len(index_of)] * (len(ops) - head)
    return layers, len(index_of)


def _layer_cuts(graph: Graph, ops: Sequence[Op], stages: int, layers_per_stage: Sequence[int]) -> list[int]:
    """Cut indices into ``ops``: stage ``s`` starts at the first op of its first layer.

    Raises:
        ValueError: naming ``layers_per_stage`` when its counts do not give ``stages`` stages of the
            model's layers, or leave a stage without ops.
    """
    layers, count = model_layers(graph, ops)
    if len(layers_per_stage) != stages or sum(layers_per_stage) != count:
        raise ValueError(
            f"pipeline: layers_per_stage {list(layers_per_stage)} must give {stages} stages (chunks) and add up to "
            f"the model's {count} layers (numbered modules such as blocks.0)"
        )
    if any(layers_in_stage == 0 for layers_in_stage in layers_per_stage[1:-1]):
        raise ValueError(
            f"pipeline: layers_per_stage {list(layers_per_stage)}: only the first and the last stage may hold 0 layers "
            "(the embeddings or the head alone)"
        )
    cuts, boundary = [], 0
    for layers_in_stage in layers_per_stage[:-1]:
        boundary += layers_in_stage
        cut = next((index for index, layer in enumerate(layers) if layer >= boundary), None)
        if cut is None or cut == 0 or (cuts and cut <= cuts[-1]):
            raise ValueError(
                f"pipeline: layers_per_stage {list(layers_per_stage)} leaves a stage without ops "
                "(the model has no embeddings before its first layer, or no head after its last)"
            )
        cuts.append(cut)
    return cuts


def op_kinds(graph: Graph, ops: list[Op], producer: dict[str, Op]) -> dict[str, str]:
    """Per op: ``prologue`` (no parameter upstream: needs no gradient), ``weights`` (parameters
    upstream but not the batch) or ``batch`` (both: the ops a pipeline's stages cut)."""
    needs_grad: dict[str, bool] = {}
    reads_batch: dict[str, bool] = {}
    kind: dict[str, str] = {}
    for op in ops:
        grad = batch = False
        for piece in op.tensor_inputs:
            if piece.name in producer:
                grad |= needs_grad[producer[piece.name].name]
                batch |= reads_batch[producer[piece.name].name]
            else:
                tensor = graph.tensors[piece.name]
                grad |= tensor.role == "parameter" and tensor.requires_grad
                batch |= tensor.role == "input"
        needs_grad[op.name], reads_batch[op.name] = grad, batch
        kind[op.name] = "prologue" if not grad else "batch" if batch else "weights"
    return kind


def _gradient_flows(graph: Graph, ops: list[Op], producer: dict[str, Op]) -> dict[str, bool]:
    """Per op: whether a gradient flows through it (not under ``no_grad``, reading a trained
    parameter or an output a gradient flows through)."""
    flows: dict[str, bool] = {}
    for op in ops:
        flows[op.name] = not op.no_grad and any(
            flows[producer[piece.name].name] if piece.name in producer
            else graph.tensors[piece.name].role == "parameter" and graph.tensors[piece.name].requires_grad
            for piece in op.tensor_inputs
        )
    return flows


def op_cost(op: Op) -> float:
    """Estimated work of ``op``: the FLOPs of matmuls, attention and convolutions (``ir.work.op_work``, the
    simulator's rule), elements read and written otherwise."""
    work = op_work(op)
    if work.matmul:
        return work.flops
    return float(sum(math.prod(piece.shape) for piece in (*op.outputs, *op.tensor_inputs)))


def _balanced_cuts(ops: Sequence[Op], stages: int, costs: Sequence[float]) -> list[int]:
    """``stages - 1`` cut indices into ``ops`` of near equal ``costs`` (one per op), at *light* places where possible.

    Around each target ``k × total / stages`` (within half a stage's cost), a light place is one
    where at most 1.25 times the fewest bytes crossing there cross — between transformer blocks, the
    residual stream alone; the cut goes to the light place nearest the target. Where no place lies
    that near (one op outweighs a stage, e.g. a large vocabulary's head), it goes to the nearest place
    crossing at most 1.25 times the fewest bytes crossing anywhere inside the model (its middle 80 %).
    """
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    crossing = _crossing_bytes(ops)
    total, cuts, previous = prefix[-1], [], 0
    inner = [crossing[index] for index in range(1, len(ops)) if 0.1 * total <= prefix[index] <= 0.9 * total]
    lightest = min(inner or crossing[1 : len(ops)], default=0)  # inside the model, not the loss's scalars
    for k in range(1, stages):
        target = k * total / stages
        allowed = range(previous + 1, len(ops) - (stages - k) + 1)
        near = [index for index in allowed if abs(prefix[index] - target) <= 0.5 * total / stages]
        bound = 1.25 * (min(crossing[index] for index in near) if near else lightest)
        light = [index for index in (near or allowed) if crossing[index] <= bound]
        best = min(light or allowed, key=lambda index: (abs(prefix[index] - target), crossing[index]))
        cuts.append(best)
        previous = best
    return cuts


def _crossing_bytes(ops: Sequence[Op]) -> list[int]:
    """``crossing[i]``: bytes of the tensors written by ``ops[:i]`` and read by ``ops[i:]``."""
    position = {op.name: index for index, op in enumerate(ops)}
    produced_at = {output.name: (position[op.name], output.nbytes) for op in ops for output in op.outputs}
    last_read: dict[str, int] = {}
    for index, op in enumerate(ops):
        for piece in op.tensor_inputs:
            if piece.name in produced_at:
                last_read[piece.name] = index
    delta = [0] * (len(ops) + 2)
    for name, last in last_read.items():
        first, size = produced_at[name]
        delta[first + 1] += size
        delta[last + 1] -= size
    crossing, running = [], 0
    for index in range(len(ops) + 1):
        running += delta[index]
        crossing.append(running)
    return crossing
