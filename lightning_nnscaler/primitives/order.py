"""op_order: a happens-before edge between two ops (how pipeline schedules are built)."""

from __future__ import annotations

from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir.op import Op
from lightning_nnscaler.ir.validate import stable_topological_order


def op_order(graph: Graph, before: Op | str, after: Op | str) -> None:
    """Make ``before`` happen before ``after``, and reorder the graph's ops to honour it.

    Raises:
        DeadlockError: listing the cycle when the edge contradicts the data dependencies or
            earlier edges; the graph is left unchanged.
    """
    first, second = graph.op(before), graph.op(after)
    graph.order_edges.append((first.name, second.name))
    try:
        graph.ops = stable_topological_order(graph)
    except Exception:
        graph.order_edges.pop()
        raise
