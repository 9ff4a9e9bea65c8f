"""Reference interpreter: run a (partitioned, placed) graph in one process, under autograd.

Every piece an op writes is kept with its masks. When an op reads a piece, the interpreter
assembles it from whatever pieces of that tensor exist: overlapping index boxes are cut out and
value parts are added up; a value part ``k of n`` requested by a consumer is the whole value for
``k = 0`` and zeros otherwise (an exact split). Replicas of a piece are taken once. This is the
correctness oracle: no communication, no devices, just the masks' arithmetic.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from lightning_nnscaler.ir.errors import NnScalerError
from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir import randomness  # noqa: F401 - registers the random ops (torch.ops.lnn.random*)
from lightning_nnscaler.ir.op import Op, resolve_target
from lightning_nnscaler.ir.tensor import VTensor, covers_exactly

Pieces = dict[str, list[tuple[VTensor, torch.Tensor]]]


class InterpretError(NnScalerError, RuntimeError):
    """The graph cannot be executed as planned (a piece is missing, or an op's result has the wrong shape)."""


def run_graph(graph: Graph, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Execute ``graph`` with values for its input tensors; returns each output tensor, whole.

    Args:
        graph: Any graph, partitioned or not.
        inputs: A value for every name in ``graph.inputs`` (constants default to the graph's own).
    """
    pieces: Pieces = {}
    for name in graph.inputs:
        value = inputs.get(name, graph.constant_values.get(name))
        if value is None:
            raise InterpretError(f"no value given for graph input %{name}")
        pieces[name] = [(graph.tensors[name].full(), value)]
    for op in graph.ops:
        _run_op(op, pieces)
    return {name: assemble(pieces, graph.tensors[name].full()) for name in graph.outputs}


def call_op(op: Op, value_of: Callable[[int, VTensor], torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Run ``op`` once with ``value_of(i, piece)`` for its input piece ``i`` (under ``no_grad`` when the op is); returns its results.

    Raises:
        InterpretError: the operator raised (the message names the op).
    """
    args, kwargs = op.map_tensor_inputs(value_of)
    grad_mode = torch.no_grad() if op.no_grad else contextlib.nullcontext()
    with grad_mode:
        try:
            result = resolve_target(op.target)(*args, **dict(kwargs))
        except Exception as error:  # noqa: BLE001 - name the op whatever failed
            raise InterpretError(f"op {op.name!r} ({op.target}) failed: {error}") from error
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def _run_op(op: Op, pieces: Pieces) -> None:
    results = call_op(op, lambda _, piece: assemble(pieces, piece, reader=op.name))
    for output, value in zip(op.outputs, results, strict=True):
        if tuple(value.shape) != output.shape:
            raise InterpretError(f"op {op.name!r} ({op.target}) wrote shape {tuple(value.shape)} for {output}, planned {output.shape}")
        pieces.setdefault(output.name, []).append((output, value))


def assemble(pieces: Pieces, wanted: VTensor, reader: str = "the graph output") -> torch.Tensor:
    """The value of piece ``wanted`` from the pieces written so far."""
    available = pieces.get(wanted.name, [])
    for piece, value in available:
        if piece.index == wanted.index and piece.value == wanted.value:
            return value
    whole = _sum_overlaps(available, wanted, reader)
    if wanted.value.is_full or wanted.value.part == 0:
        return whole
    return torch.zeros_like(whole)


def _sum_overlaps(available: list[tuple[VTensor, torch.Tensor]], wanted: VTensor, reader: str) -> torch.Tensor:
    distinct: dict[tuple[Any, Any], tuple[VTensor, torch.Tensor]] = {}
    for piece, value in available:
        distinct.setdefault((piece.index, piece.value), (piece, value))
    if not covers_exactly(wanted.index, [(piece.index, piece.value) for piece, _ in distinct.values()]):
        raise InterpretError(
            f"{reader} reads {wanted} but the pieces written so far do not add up to exactly one whole value of it; "
            "check the op_trans splits of its producers"
        )
    total: torch.Tensor | None = None
    for piece, value in distinct.values():
        overlap = piece.index.intersect(wanted.index)
        if overlap is None:
            continue
        if overlap == wanted.index and overlap == piece.index:
            contribution = value
        else:
            contribution = torch.zeros(wanted.shape, dtype=value.dtype)
            contribution[overlap.slices_within(wanted.index)] = value[overlap.slices_within(piece.index)]
        total = contribution if total is None else total + contribution
    assert total is not None
    return total
