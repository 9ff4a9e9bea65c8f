"""Drop the empty tensors that ``torch.cat`` skips: Hugging Face's key/value caches start as ``torch.tensor([])``.

A ``DynamicCache`` layer begins empty and its first update is ``torch.cat([torch.tensor([]), keys], dim=-2)``:
torch skips a 1-D tensor with no elements next to tensors of any rank. Captured, that empty tensor is a
lifted constant read by every layer; it carries no batch, no heads and no data, yet each rank and
microbatch would have to be handed it. `drop_empty_concatenations` removes it from each such ``cat``
(in place, before conversion), and the chain that made it once nothing else reads it (a ``cat`` of one
tensor stays: its result is a new tensor, as before).
"""

from __future__ import annotations

import torch
from torch import fx
from torch.export import ExportedProgram

_CAT = torch.ops.aten.cat.default


def drop_empty_concatenations(exported: ExportedProgram) -> ExportedProgram:
    """Remove the 1-D empty operands of every ``aten.cat`` of ``exported`` whose other operands have more dims; returns it."""
    graph = exported.graph
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _CAT or not isinstance(node.args[0], (list, tuple)):
            continue
        operands = list(node.args[0])
        rank = node.meta["val"].dim()
        kept = [operand for operand in operands if not _skipped_by_cat(operand, rank)]
        if not kept or len(kept) == len(operands):
            continue
        node.args = (kept, *node.args[1:])
        changed = True
        for dropped in operands:
            if dropped not in kept:
                _erase_unread(graph, dropped)
    if changed:
        graph.lint()
        exported.graph_module.recompile()
    return exported


def _skipped_by_cat(operand: object, rank: int) -> bool:
    value = operand.meta.get("val") if isinstance(operand, fx.Node) else None
    return isinstance(value, torch.Tensor) and rank > 1 and tuple(value.shape) == (0,)


def _erase_unread(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` and then its producers, as long as nothing else reads them (graph inputs stay)."""
    stack = [node]
    while stack:
        current = stack.pop()
        if current.op != "call_function" or current.users:
            continue
        producers = [argument for argument in current.all_input_nodes]
        graph.erase_node(current)
        stack.extend(producers)
