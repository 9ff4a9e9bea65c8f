"""op_assign: place an op (or a piece) on a device."""

from __future__ import annotations

from lightning_nnscaler.ir.errors import NnScalerError
from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir.op import Op


class AssignError(NnScalerError, ValueError):
    """A placement that cannot be right."""


def op_assign(graph: Graph, op: Op | str, device: int, *, segment: tuple[int, int] | None = None) -> Op:
    """Run ``op`` on ``device`` (a rank); returns the placed op.

    ``segment=(stage, microbatch)`` also places it in that segment of a pipeline (the ops of one
    stage and microbatch on a device run as one unit of the schedule; ``ir.op.PROLOGUE`` for the
    step's prologue); ``None`` keeps the op's segment.

    Raises:
        AssignError: naming the op when ``device`` is not a non-negative int.
    """
    op = graph.op(op)
    if not isinstance(device, int) or isinstance(device, bool) or device < 0:
        raise AssignError(f"op {op.name!r}: device must be a non-negative int (a rank), got {device!r}")
    if segment is not None and (not isinstance(segment, tuple) or len(segment) != 2 or not all(isinstance(part, int) for part in segment)):
        raise AssignError(f"op {op.name!r}: segment must be a (stage, microbatch) pair of ints, got {segment!r}")
    placed = op.placed(device, op.segment if segment is None else segment)
    graph.replace_op(op, [placed])
    return placed
