"""Data parallelism: every device runs the whole model on its slice of the batch."""

from __future__ import annotations

from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir.op import Op
from lightning_nnscaler.plans.context import PlanContext
from lightning_nnscaler.plans.propagate import assign_pieces, propagate, replicate


def dp(graph: Graph, ctx: PlanContext) -> None:
    """Split the batch (dim 0 of every user input) over all devices; replicate what it does not reach.

    The loss ends up value-partial (device ``j`` holds its batch slice's share of the mean), so
    each device's backward gives its share of every gradient: the runtime all-reduces them.
    """
    for pieces in split_batch(graph, ctx.world_size):
        assign_pieces(graph, pieces, range(ctx.world_size))


def split_batch(graph: Graph, parts: int) -> list[list[Op]]:
    """Every op, in graph order, as ``parts`` pieces: batch slices where the batch split reaches, replicas elsewhere.

    Raises:
        ValueError: naming the input when ``parts`` does not divide its batch dim.
    """
    seeds = {tensor.name: 0 for tensor in graph.user_inputs if tensor.rank >= 1}
    for name in seeds:
        if graph.tensors[name].shape[0] % parts:
            raise ValueError(
                f"data parallelism over {parts} parts: input %{name} has batch size {graph.tensors[name].shape[0]}, "
                f"which {parts} does not divide; trace with a batch size that is a multiple of {parts}"
            )
    walk = propagate(graph, parts, seeds=seeds, through_value=True)  # the loss division splits by value
    return [pieces if pieces is not None else replicate(graph, op, parts) for op, pieces in walk.steps]
