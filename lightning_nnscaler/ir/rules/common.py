"""Dimension annotations for the ATen ops that traced models produce.

Each rule reads the call (pieces carry shapes) and writes the annotation language described in
``lightning_nnscaler.ir.annotation``. Ops without a rule can still be replicated.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator

from lightning_nnscaler.ir.rules.registry import register_annotation
from lightning_nnscaler.ir.annotation import DimAnnotation
from lightning_nnscaler.ir.op import Op
from lightning_nnscaler.ir.tensor import VTensor


def _names() -> Iterator[str]:
    yield from "abcdefghijklmnopqrstuvwxyz"
    for index in itertools.count():
        yield f"z{index}"


def _text(inputs: list[list[str]], outputs: list[list[str]], value: tuple[int, ...] = ()) -> str:
    """The annotation in its canonical text: every occurrence of a ``+``/``^`` name carries its mark."""
    text = ", ".join(" ".join(spec) or "()" for spec in inputs) + " -> " + ", ".join(" ".join(spec) or "()" for spec in outputs)
    return str(DimAnnotation.parse(text + ("; value " + " ".join(map(str, value)) if value else "")))


def _tensor_operands_only(op: Op) -> bool:
    return all(isinstance(arg, VTensor) for arg in op.args)


def argument(op: Op, position: int | None, keyword: str, default: Any) -> Any:
    """An argument given by position or by keyword (``position=None``: keyword-only)."""
    if position is not None and len(op.args) > position:
        return op.args[position]
    return op.kwargs_dict.get(keyword, default)


def _floating(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat", "complex"))


def exact_value_inputs(op: Op, positions: tuple[int, ...]) -> tuple[int, ...]:
    """``positions`` if splitting those inputs into value parts is exact for the op's dtypes, else ``()``.

    Partial sums of bools mean nothing (``True + True``), and a float-to-integer conversion rounds
    each part on its own; integer and floating parts add up exactly otherwise.
    """
    inputs = [op.tensor_inputs[position].tensor.dtype for position in positions]
    outputs = [output.tensor.dtype for output in op.outputs]
    if "bool" in inputs + outputs:
        return ()
    if any(map(_floating, inputs)) and not all(map(_floating, outputs)):
        return ()
    return positions


def _broadcast(op: Op, frozen_dims: set[int] = frozenset(), value: tuple[int, ...] = ()) -> str:
    """Elementwise with right-aligned broadcasting; output dims in ``frozen_dims`` get ``^``."""
    out_shape = op.outputs[0].shape
    fresh = _names()
    out = [next(fresh) + ("^" if dim in frozen_dims else "") for dim in range(len(out_shape))]
    bare = [name.rstrip("^") for name in out]
    inputs = []
    for piece in op.tensor_inputs:
        offset = len(out_shape) - len(piece.shape)
        inputs.append([bare[offset + i] if size == out_shape[offset + i] else "1" for i, size in enumerate(piece.shape)])
    return _text(inputs, [out] * len(op.outputs), exact_value_inputs(op, value))


def _normalized_dims(dims: object, rank: int) -> list[int]:
    if dims is None:
        return list(range(rank))
    items = dims if isinstance(dims, (list, tuple)) else [dims]
    return sorted({int(dim) % max(rank, 1) for dim in items}) if items else list(range(rank))


# --- elementwise -------------------------------------------------------------------------------

_NONLINEAR_UNARY = """gelu tanh relu silu sigmoid exp log log1p rsqrt sqrt erf abs sin cos logical_not
bitwise_not reciprocal sign floor ceil round hardtanh leaky_relu elu softplus mish isnan""".split()
for _name in _NONLINEAR_UNARY:
    register_annotation(f"aten.{_name}.default")(lambda op: _broadcast(op))
register_annotation(
    "aten.pow.Tensor_Scalar", "aten.pow.Tensor_Tensor", "aten.add.Scalar", "aten.sub.Scalar", "aten.rsub.Scalar",
    "aten.eq.Scalar", "aten.ne.Scalar", "aten.lt.Scalar", "aten.le.Scalar", "aten.gt.Scalar", "aten.ge.Scalar",
    "aten.eq.Tensor", "aten.ne.Tensor", "aten.lt.Tensor", "aten.le.Tensor", "aten.gt.Tensor", "aten.ge.Tensor",
    "aten.maximum.default", "aten.where.self", "aten.masked_fill.Scalar",
    "aten.masked_fill.Tensor", "aten.logical_and.default", "aten.logical_or.default", "aten.bitwise_and.Tensor",
    "aten.bitwise_or.Tensor", "aten.__and__.Tensor", "aten.__or__.Tensor", "aten.bitwise_xor.Tensor",
    "aten.minimum.default", "aten.min.other", "aten.max.other", "aten.where.ScalarOther", "aten.where.ScalarSelf",
    "aten.fill.Scalar", "aten.clamp.default", "aten.clamp_min.default", "aten.clamp_max.default",
    "aten.gelu_backward.default", "aten.zeros_like.default", "aten.ones_like.default", "aten.empty_like.default",
    "aten.full_like.default",
    "aten.broadcast_tensors.default",  # each output is its input broadcast to the common shape (mse_loss's prelude)
)(lambda op: _broadcast(op))

_LINEAR_UNARY = """neg clone alias contiguous detach lift_fresh_copy _to_copy""".split()
for _name in _LINEAR_UNARY:
    register_annotation(f"aten.{_name}.default")(lambda op: _broadcast(op, value=(0,)))
register_annotation(
    "aten.to.dtype", "aten.to.dtype_layout", "aten.to.device", "aten.mul.Scalar", "aten.div.Scalar",
    "aten.dropout.default",  # capture keeps only dropouts that draw nothing (p = 0 or eval); others become ``lnn.random``
)(lambda op: _broadcast(op, value=(0,)))


@register_annotation("aten.type_as.default")
def _type_as(op: Op) -> str:
    # Only the dtype of ``other`` matters: its dims are unrelated to the result's.
    fresh = _names()
    names = [next(fresh) for _ in op.tensor_inputs[0].shape]
    other = [next(fresh) + "^" for _ in op.tensor_inputs[1].shape]
    return _text([names, other], [names], exact_value_inputs(op, (0,)))


@register_annotation("aten.fill.Tensor", "aten.copy.default")
def _fill_from(op: Op) -> str:
    # fill(self, value) and copy(self, src): the result is the second operand broadcast to self's
    # shape; self's values are not read, so the result is linear in the second operand alone.
    return _broadcast(op, value=(1,))


@register_annotation("aten.add.Tensor", "aten.sub.Tensor")
def _add(op: Op) -> str:
    # Linear in both operands only when both are tensors: x + 1.0 is affine.
    both = _tensor_operands_only(op) and len(op.tensor_inputs) == 2
    return _broadcast(op, value=(0, 1) if both else ())


@register_annotation("aten.mul.Tensor", "aten.div.Tensor")
def _mul(op: Op) -> str:
    return _broadcast(op, value=(0,))


# --- reductions ---------------------------------------------------------------------------------


def _reduction(op: Op, dims: object, keepdim: bool, mark: str, value: tuple[int, ...]) -> str:
    source = op.tensor_inputs[0]
    reduced = set(_normalized_dims(dims, len(source.shape)))
    fresh = _names()
    names = [next(fresh) for _ in source.shape]
    inputs = [[name + (mark if dim in reduced else "") for dim, name in enumerate(names)]]
    if keepdim:
        out = ["1" if dim in reduced else name for dim, name in enumerate(names)]
    else:
        out = [name for dim, name in enumerate(names) if dim not in reduced]
    return _text(inputs, [out] * len(op.outputs), exact_value_inputs(op, value))


@register_annotation("aten.sum.dim_IntList")
def _sum_dims(op: Op) -> str:
    keepdim = op.args[2] if len(op.args) > 2 else op.kwargs_dict.get("keepdim", False)
    return _reduction(op, op.args[1], bool(keepdim), "+", (0,))


@register_annotation("aten.sum.default")
def _sum_all(op: Op) -> str:
    return _reduction(op, None, False, "+", (0,))


# Reductions that are not sums: the reduced dims stay whole. Per target, the positions of the
# ``dim`` and ``keepdim`` arguments in its ATen schema (``None``: keyword-only).
_FROZEN_REDUCTIONS: dict[str, tuple[int, int | None]] = {
    "aten.amax.default": (1, 2), "aten.amin.default": (1, 2), "aten.mean.dim": (1, 2), "aten.logsumexp.default": (1, 2),
    "aten.var.correction": (1, None), "aten.std.correction": (1, None), "aten.var.dim": (1, 3), "aten.std.dim": (1, 3),
    "aten.linalg_vector_norm.default": (2, 3), "aten.any.dim": (1, 2), "aten.all.dim": (1, 2),
    "aten.argmax.default": (1, 2), "aten.argmin.default": (1, 2), "aten.max.dim": (1, 2), "aten.min.dim": (1, 2),
    "aten.prod.dim_int": (1, 2),
}


@register_annotation(*_FROZEN_REDUCTIONS)
def _frozen_reduction(op: Op) -> str:
    dim_position, keepdim_position = _FROZEN_REDUCTIONS[op.target]
    dims = argument(op, dim_position, "dim", None)
    keepdim = argument(op, keepdim_position, "keepdim", False)
    return _reduction(op, dims, bool(keepdim), "^", ())


@register_annotation("aten.mean.default", "aten.any.default", "aten.all.default")
def _frozen_reduction_all(op: Op) -> str:
    return _reduction(op, None, False, "^", ())


@register_annotation("aten.softmax.int", "aten._softmax.default", "aten.log_softmax.int", "aten._log_softmax.default")
def _along_dim(op: Op) -> str:
    return _broadcast(op, frozen_dims={int(op.args[1]) % max(len(op.outputs[0].shape), 1)})


@register_annotation("aten.cumsum.default")
def _cumulative_sum(op: Op) -> str:
    return _broadcast(op, frozen_dims={int(op.args[1]) % max(len(op.outputs[0].shape), 1)}, value=(0,))


@register_annotation("aten.triu.default", "aten.tril.default")
def _triangle(op: Op) -> str:
    rank = len(op.outputs[0].shape)
    return _broadcast(op, frozen_dims={rank - 2, rank - 1}, value=(0,))
