"""op_recompute: mark an op as part of an activation-recompute group (the one plan edit besides the primitives)."""

from __future__ import annotations

from dataclasses import replace

from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir.op import Op


def op_recompute(graph: Graph, op: Op | str, group: int | None) -> Op:
    """Put ``op`` in recompute ``group`` (``None`` to keep its activations); returns the marked op.

    Ops of one device sharing a group keep no activations for backward: their forward runs again
    during backward (see ``Op.recompute``).
    """
    op = graph.op(op)
    if group is not None and (not isinstance(group, int) or isinstance(group, bool) or group < 0):
        raise ValueError(f"op {op.name!r}: recompute group must be a non-negative int or None, got {group!r}")
    marked = replace(op, recompute=group)
    graph.replace_op(op, [marked])
    return marked
