"""op_assign: place an op (or a piece) on a device."""

from __future__ import annotations

from dataclasses import replace

from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir.op import Op


class AssignError(ValueError):
    """A placement that cannot be right."""


def op_assign(graph: Graph, op: Op | str, device: int) -> Op:
    """Run ``op`` on ``device`` (a rank); returns the placed op.

    Raises:
        AssignError: naming the op when ``device`` is not a non-negative int.
    """
    op = graph.op(op)
    if not isinstance(device, int) or isinstance(device, bool) or device < 0:
        raise AssignError(f"op {op.name!r}: device must be a non-negative int (a rank), got {device!r}")
    placed = replace(op, device=device)
    graph.replace_op(op, [placed])
    return placed
