"""op_order / op_orders: happens-before edges between ops (how pipeline schedules are built)."""

from __future__ import annotations

from collections.abc import Iterable

from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir.op import Op
from lightning_nnscaler.ir.validate import stable_topological_order


def op_order(graph: Graph, before: Op | str, after: Op | str) -> None:
    """Make ``before`` happen before ``after``, and reorder the graph's ops to honour it.

    Costs one re-sort, O((V + E) log V) for V ops and E order edges plus data dependencies: to add
    many edges, call ``op_orders`` once instead.

    Raises:
        DeadlockError: listing the cycle when the edge contradicts the data dependencies or
            earlier edges; the graph is left unchanged.
    """
    op_orders(graph, [(before, after)])


def op_orders(graph: Graph, edges: Iterable[tuple[Op | str, Op | str]]) -> None:
    """Add every happens-before edge ``(before, after)`` of ``edges``, then reorder the graph's ops once.

    The new order is ``stable_topological_order`` of the order before the call under all the edges:
    the ops move as little as possible, whatever order ``edges`` lists them in. (Calling ``op_order``
    per edge gives the same constraints, but each call starts from the order the previous one left,
    so ops that no edge orders relative to each other can end up in a different list order.)

    Complexity: O(k) to add k edges plus one re-sort, O((V + E) log V) for V ops and E edges (order
    edges and data dependencies), instead of k re-sorts.

    Raises:
        GraphError: An edge names an op that is not in the graph; no edge is added.
        DeadlockError: The edges contradict the data dependencies, earlier edges or each other; the
            message lists one cycle; no edge is added and the order is unchanged.
    """
    new_edges = _edge_names(graph, edges)
    kept = len(graph.order_edges)
    graph.order_edges.extend(new_edges)
    try:
        graph.ops = stable_topological_order(graph)
        graph.mark_dependency_order()
    except Exception:
        del graph.order_edges[kept:]
        raise


def _edge_names(graph: Graph, edges: Iterable[tuple[Op | str, Op | str]]) -> list[tuple[str, str]]:
    """``(before, after)`` op names, each checked to be in the graph (one dict for all lookups)."""
    names = {op.name for op in graph.ops}

    def name_of(op: Op | str) -> str:
        name = op if isinstance(op, str) else op.name
        return name if name in names else graph.op(name).name  # graph.op raises, naming the pieces

    return [(name_of(before), name_of(after)) for before, after in edges]
