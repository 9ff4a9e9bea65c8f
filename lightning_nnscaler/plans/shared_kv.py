"""Grouped-query attention with fewer key/value heads than tensor-parallel ranks: each kv head on ``parts / kv`` ranks.

With ``kv`` key/value heads shared by ``H`` query heads (Llama, Qwen2, Mistral) and ``parts > kv`` ranks, the
key/value heads cannot be cut ``parts`` ways. vLLM and TensorRT-LLM replicate each kv head over
``parts / kv`` ranks, and so does this: the ops from ``k_proj`` / ``v_proj`` up to the repeat that widens
the kv heads to ``H`` (Hugging Face's ``repeat_kv``: ``x[:, :, None].expand(B, kv, H / kv, T, D).reshape(B, H, T, D)``)
are split by kv head into ``kv`` pieces with op_trans, each piece copied ``parts / kv`` times (op_trans
``replicate``), so that rank ``i`` holds kv head ``i // (parts / kv)`` — exactly the one its query heads
``[i H / parts, (i + 1) H / parts)`` read (query head ``h`` reads kv head ``h // (H / kv)``). The attention
then takes its heads' rows of the widened keys and values from the copy on its own rank: no communication.
Each kv projection's gradient is summed over the ``parts / kv`` ranks that share a head.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir.op import Op
from lightning_nnscaler.plans.propagate import Choose, Walk, propagate, replicate

ATTENTION = "aten.scaled_dot_product_attention.default"
_VIEWS = {"aten.view.default", "aten.reshape.default", "aten._unsafe_view.default"}


@dataclass(frozen=True)
class SharedHeads:
    """The ops of one attention's keys or values from their projection to their widening, and their kv head count."""

    ops: tuple[str, ...]
    """In graph order: the projection, the ops after it, the unsqueeze, expand and reshape of ``repeat_kv``."""
    kv_heads: int


def shared_kv_heads(graph: Graph, ops: Sequence[str], parts: int) -> list[SharedHeads]:
    """The key and value paths of each grouped-query attention among ``ops`` (names in graph order) whose ``kv_heads``
    ``parts`` cannot cut but is a multiple of (``parts % kv_heads == 0``), and whose query heads ``parts`` divides.

    Looks only at ``ops``, not the whole graph: a recipe asks once per segment of a large plan."""
    region = [graph.op(name) for name in ops]
    producers = {output.name: op for op in region for output in op.outputs}
    found: list[SharedHeads] = []
    taken: set[str] = set()  # a path read by several attentions is split once
    for op in region:
        if op.target != ATTENTION or len(op.tensor_inputs) < 3:
            continue
        heads = op.tensor_inputs[0].shape[1]
        for position in (1, 2):
            path = _widening(op.tensor_inputs[position].name, producers)
            if path is None:
                continue
            kv_heads = path[-1].tensor_inputs[0].shape[1]  # the unsqueeze's input (B, kv, T, D)
            if kv_heads < parts and parts % kv_heads == 0 and heads % parts == 0 and heads % kv_heads == 0 and path[0].name not in taken:
                members = tuple(item.name for item in _between(region, path, producers) if item.name not in taken)
                taken.update(members)
                found.append(SharedHeads(members, kv_heads))
    return found


def _widening(name: str, producers: dict[str, Op]) -> list[Op] | None:
    """``[reshape, expand, unsqueeze]`` of ``repeat_kv`` producing tensor ``name``, or None."""
    reshape = producers.get(name)
    expand = producers.get(reshape.tensor_inputs[0].name) if reshape is not None and reshape.target in _VIEWS else None
    unsqueeze = producers.get(expand.tensor_inputs[0].name) if expand is not None and expand.target == "aten.expand.default" else None
    if unsqueeze is None or unsqueeze.target != "aten.unsqueeze.default" or len(unsqueeze.tensor_inputs[0].shape) != 4:
        return None
    kv, length, size = unsqueeze.tensor_inputs[0].shape[1:]
    if len(expand.outputs[0].shape) != 5 or reshape.outputs[0].shape[2:] != (length, size) or expand.outputs[0].shape[1] != kv:
        return None
    return [reshape, expand, unsqueeze]


def _between(region: Sequence[Op], path: list[Op], producers: dict[str, Op]) -> list[Op]:
    """The widening ops and every op upstream of it up to and including its projection (a linear), in the order of
    ``region`` (the ops searched, in graph order; ``producers`` writes their outputs)."""
    from lightning_nnscaler.plans.megatron_tp import is_linear  # megatron_tp imports this module

    upstream: set[str] = set()
    stack = [path[-1]]
    projections: set[str] = set()
    while stack:
        op = stack.pop()
        if op.name in upstream:
            continue
        upstream.add(op.name)
        if is_linear(op):
            projections.add(op.name)
            continue
        stack.extend(producers[piece.name] for piece in op.tensor_inputs if piece.name in producers)
    downstream = set(projections)  # ops that read the projections, directly or through others
    for op in region:
        if op.name in upstream and any(piece.name in producers and producers[piece.name].name in downstream for piece in op.tensor_inputs):
            downstream.add(op.name)
    members = (upstream & downstream) | {op.name for op in path}
    return [op for op in region if op.name in members]


def split_shared_heads(graph: Graph, shared: Sequence[SharedHeads], parts: int, choose: Choose) -> Walk:
    """Split each path by kv head into ``kv_heads`` pieces, each copied ``parts / kv_heads`` times: the walk's steps
    hold ``parts`` pieces per op, piece ``i`` for rank ``i`` of the group (ops the split did not reach stay whole)."""
    walk = Walk()
    for heads in shared:
        split = propagate(graph, heads.kv_heads, ops=heads.ops, choose=choose)
        offset = len(walk.steps)
        for index, (op, pieces) in enumerate(split.steps):
            copies = None if pieces is None else [copy for piece in pieces for copy in replicate(graph, piece, parts // heads.kv_heads)]
            walk.steps.append((op, copies))
            walk.feeds.append(tuple(offset + feed for feed in split.feeds[index]))
        walk.refused.extend(split.refused)
    return walk


def merge_walks(order: Sequence[str], walk: Walk, copied: Walk) -> Walk:
    """``walk`` and the kv paths' ``copied`` as one walk in the graph ``order`` of their ops; an op of ``walk`` that
    reads a path's widened heads is fed by it, so that ``Walk.runs`` keeps the path in its attention's stretch."""
    position = {name: index for index, name in enumerate(order)}
    steps = walk.steps + copied.steps
    feeds = list(walk.feeds) + [tuple(len(walk.steps) + feed for feed in feeds) for feeds in copied.feeds]
    produced_by = {output.name: len(walk.steps) + index for index, (op, pieces) in enumerate(copied.steps) if pieces is not None for output in op.outputs}
    for index, (op, _) in enumerate(walk.steps):
        extra = {produced_by[piece.name] for piece in op.tensor_inputs if piece.name in produced_by}
        feeds[index] = tuple(sorted(set(feeds[index]) | extra))
    ranked = sorted(range(len(steps)), key=lambda index: position[steps[index][0].name])
    new_index = {old: new for new, old in enumerate(ranked)}
    merged = Walk(refused=walk.refused + copied.refused)
    for old in ranked:
        merged.steps.append(steps[old])
        merged.feeds.append(tuple(sorted(new_index[feed] for feed in feeds[old])))
    return merged
