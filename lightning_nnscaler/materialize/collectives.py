"""Choosing collectives for a tensor whose producers and consumers both form regular R·V·D layouts.

When every piece the producers wrote and every piece one consumer op's pieces read are regular
layouts over the same devices, the RVD search prices the transition; a path made only of steps
the runtime runs as collectives (all-reduce, all-gather, reduce-scatter, local chunk, local value
split) whose sub-groups list their members in rank order replaces the point-to-point plan.
Anything else (several pieces on one device, uneven chunks, groups that differ) stays P2P.
"""

from __future__ import annotations

from lightning_nnscaler.ir.tensor import DTYPE_BYTES, VTensor
from lightning_nnscaler.materialize.layouts import Layout
from lightning_nnscaler.materialize.search import AlphaBeta, CostModel, Path, search

RUNNABLE = {"all-reduce", "all-gather", "reduce-scatter", "local-chunk", "local-value-split"}


def collective_path(sources: dict[int, VTensor], targets: dict[int, VTensor], cost: CostModel | None = None) -> Path | None:
    """The RVD path from the pieces ``sources`` (device -> piece) to ``targets``, if it runs as collectives.

    Returns ``None`` when the layouts are irregular, span different devices, the search prefers
    point to point, or a step cannot run as the runtime's collectives.
    """
    if set(sources) != set(targets) or len(sources) < 2:
        return None
    tensor = next(iter(sources.values())).tensor
    if tensor.dtype not in DTYPE_BYTES or not tensor.dtype.startswith(("float", "bfloat")):
        return None
    source = Layout.from_pieces(tensor.shape, {device: (piece.index, piece.value) for device, piece in sources.items()})
    target = Layout.from_pieces(tensor.shape, {device: (piece.index, piece.value) for device, piece in targets.items()})
    if source is None or target is None or len(tensor.shape) == 0:
        return None
    path = search(tensor.shape, DTYPE_BYTES[tensor.dtype], source, target, cost or AlphaBeta())
    if not path.steps or path.is_fallback or any(step.kind not in RUNNABLE for step in path.steps):
        return None
    for step in path.steps:
        if step.kind in ("all-gather", "reduce-scatter") and not _chunks_in_rank_order(step, tensor.shape):
            return None
    return path


def _chunks_in_rank_order(step: object, shape: tuple[int, ...]) -> bool:
    """all-gather concatenates, and reduce-scatter hands out, chunks in ascending rank order."""
    dim = step.dims[0]
    layout = step.before if step.kind == "all-gather" else step.after
    for group in step.groups:
        starts = [layout.piece_of(device, shape)[0].ranges[dim][0] for device in sorted(group)]
        if starts != sorted(starts):
            return False
    return True


def group_of(step: object, device: int) -> tuple[int, ...]:
    """The sorted sub-group of ``step`` that ``device`` belongs to."""
    for group in step.groups:
        if device in group:
            return tuple(sorted(group))
    raise ValueError(f"device {device} is in no sub-group of {step}")
