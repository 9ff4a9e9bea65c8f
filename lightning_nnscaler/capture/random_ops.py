"""Random ATen ops written with the IR's plan-invariant random op (``ir.randomness``).

Dropout becomes ``keep = uniform >= p; x * keep * (1 / (1 - p))``; ``bernoulli`` compares a uniform
with its probability; ``rand``/``randn`` (and their ``_like``, ``uniform_``, ``normal_`` forms) are
the random op itself, scaled. Attention with dropout is written out (scores, softmax, dropout,
values) so that its dropout mask is drawn the same way. Each handler returns the node's new value,
or ``None`` when the call draws nothing (dropout with p = 0 or outside training) and is kept as is.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import fx

from lightning_nnscaler.ir.randomness import RANDOM_LIKE_OP, RANDOM_OP, op_key
from lightning_nnscaler.ir.tensor import VTensor

if TYPE_CHECKING:
    from lightning_nnscaler.capture.convert import _Converter

Handler = Callable[["_Converter", fx.Node, Any, dict, bool], Any]


def _meta(shape: Any, dtype: torch.dtype | str) -> torch.Tensor:
    """A shape-and-dtype stand-in for ``emit`` (no memory)."""
    return torch.empty(tuple(shape), dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype, device="meta")


def _dtype(piece: VTensor) -> torch.dtype:
    return getattr(torch, piece.tensor.dtype)


def _comparison_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _device(node: fx.Node) -> torch.device:
    value = node.meta["val"]
    return (value[0] if isinstance(value, (tuple, list)) else value).device


def draw(converter: _Converter, name: str, shape: Any, distribution: str, dtype: torch.dtype, device: torch.device, no_grad: bool) -> VTensor:
    """Emit one random factory over the whole ``shape``; its key is its (unique) op name."""
    op_name = converter.unique(name, converter.op_names)
    full = [int(size) for size in shape]
    args = [full, [0] * len(full), full, op_key(op_name), distribution, dtype, device]
    return converter.emit(op_name, RANDOM_OP, args, {}, _meta(full, dtype), no_grad)


def draw_like(converter: _Converter, name: str, template: VTensor, distribution: str, dtype: torch.dtype, no_grad: bool) -> VTensor:
    """Emit one random op shaped like ``template`` (whose splits it follows); its key is its (unique) op name."""
    op_name = converter.unique(name, converter.op_names)
    full = list(template.shape)
    args = [template, [0] * len(full), full, op_key(op_name), distribution, dtype]
    return converter.emit(op_name, RANDOM_LIKE_OP, args, {}, _meta(full, dtype), no_grad)


def _bound(node: fx.Node, args: Any, kwargs: dict) -> dict[str, Any]:
    """Arguments by schema name, defaults filled in."""
    values = {}
    for position, argument in enumerate(node.target._schema.arguments):
        if position < len(args):
            values[argument.name] = args[position]
        elif argument.name in kwargs:
            values[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            values[argument.name] = argument.default_value
    return values


def _dropped(converter: _Converter, node: fx.Node, x: VTensor, p: float, no_grad: bool, name: str | None = None) -> tuple[VTensor, VTensor]:
    """``(x * keep / (1 - p), keep)`` with ``keep = uniform >= p``, drawn over x's whole shape; ops named after ``name``."""
    name = name or node.name
    dtype = _dtype(x)
    uniform = draw_like(converter, f"{name}_uniform", x, "uniform", _comparison_dtype(dtype), no_grad)
    keep = converter.emit(f"{name}_keep", "aten.ge.Scalar", [uniform, p], {}, _meta(x.shape, torch.bool), no_grad)
    kept = converter.emit(f"{name}_kept", "aten.mul.Tensor", [x, keep], {}, _meta(x.shape, dtype), no_grad)
    scale = 0.0 if p >= 1 else 1.0 / (1.0 - p)
    return converter.emit(name, "aten.mul.Scalar", [kept, scale], {}, _meta(x.shape, dtype), no_grad), keep


def _dropout(converter: _Converter, node: fx.Node, args: Any, kwargs: dict, no_grad: bool) -> Any:
    bound = _bound(node, args, kwargs)
    if not bound["train"] or bound["p"] == 0:
        return None
    return _dropped(converter, node, bound["input"], float(bound["p"]), no_grad)[0]


def _native_dropout(converter: _Converter, node: fx.Node, args: Any, kwargs: dict, no_grad: bool) -> Any:
    bound = _bound(node, args, kwargs)
    if bound["train"] is False:
        return None
    return _dropped(converter, node, bound["input"], float(bound["p"]), no_grad)


def _bernoulli(converter: _Converter, node: fx.Node, args: Any, kwargs: dict, no_grad: bool) -> VTensor:
    """1 where ``uniform < p`` (p a number or a tensor of probabilities; ``bernoulli(x)``: p = x), else 0."""
    bound = _bound(node, args, kwargs)
    x: VTensor = bound["self"]
    p = bound.get("p", x)
    dtype = _dtype(x)
    uniform = draw_like(converter, f"{node.name}_uniform", x, "uniform", _comparison_dtype(dtype), no_grad)
    comparison = "aten.lt.Tensor" if isinstance(p, VTensor) else "aten.lt.Scalar"
    hit = converter.emit(f"{node.name}_hit", comparison, [uniform, p], {}, _meta(x.shape, torch.bool), no_grad)
    return converter.emit(node.name, "aten._to_copy.default", [hit], {"dtype": dtype}, _meta(x.shape, dtype), no_grad)


def _scaled(converter: _Converter, node: fx.Node, values: VTensor, scale: float, shift: float, no_grad: bool) -> VTensor:
    """``values * scale + shift`` (ops only where they change something)."""
    meta = _meta(values.shape, _dtype(values))
    if scale != 1:
        values = converter.emit(f"{node.name}_scaled", "aten.mul.Scalar", [values, scale], {}, meta, no_grad)
    if shift != 0:
        values = converter.emit(f"{node.name}_shifted", "aten.add.Scalar", [values, shift], {}, meta, no_grad)
    return values


def _factory(distribution: str) -> Handler:
    """``rand``/``randn`` (a size) and ``rand_like``/``randn_like`` (a template tensor)."""

    def handle(converter: _Converter, node: fx.Node, args: Any, kwargs: dict, no_grad: bool) -> VTensor:
        value = node.meta["val"]
        if args and isinstance(args[0], VTensor):
            return draw_like(converter, node.name, args[0], distribution, value.dtype, no_grad)
        return draw(converter, node.name, value.shape, distribution, value.dtype, value.device, no_grad)

    return handle


def _fill(distribution: str) -> Handler:
    """``uniform_(x, from, to)`` and ``normal_(x, mean, std)``: x's shape and dtype, new values."""

    def handle(converter: _Converter, node: fx.Node, args: Any, kwargs: dict, no_grad: bool) -> VTensor:
        bound = _bound(node, args, kwargs)
        x: VTensor = bound["self"]
        values = draw_like(converter, f"{node.name}_{distribution}", x, distribution, _dtype(x), no_grad)
        if distribution == "uniform":
            low, high = float(bound["from"]), float(bound["to"])
            return _scaled(converter, node, values, high - low, low, no_grad)
        return _scaled(converter, node, values, float(bound["std"]), float(bound["mean"]), no_grad)

    return handle


def _attention(converter: _Converter, node: fx.Node, args: Any, kwargs: dict, no_grad: bool) -> VTensor | None:
    """Attention with dropout, written out: softmax(q k^T * scale + mask) with dropout, times v."""
    bound = _bound(node, args, kwargs)
    p = float(bound["dropout_p"])
    if p == 0 or bound.get("enable_gqa"):
        return None
    query, key, value, mask = bound["query"], bound["key"], bound["value"], bound["attn_mask"]
    *batch, length, width = query.shape
    source = key.shape[-2]
    dtype = _dtype(query)
    scores_shape = (*batch, length, source)
    transposed = converter.emit(f"{node.name}_keys_t", "aten.transpose.int", [key, -2, -1], {}, _meta((*key.shape[:-2], width, source), dtype), no_grad)
    scores = converter.emit(f"{node.name}_scores", "aten.matmul.default", [query, transposed], {}, _meta(scores_shape, dtype), no_grad)
    scale = bound.get("scale") or 1.0 / math.sqrt(width)
    scores = converter.emit(f"{node.name}_scaled", "aten.mul.Scalar", [scores, scale], {}, _meta(scores_shape, dtype), no_grad)
    if bound["is_causal"]:
        rows = converter.emit(f"{node.name}_rows", "aten.arange.default", [length], {"device": _device(node)}, _meta((length,), torch.int64), no_grad)
        column = converter.emit(f"{node.name}_rows_column", "aten.unsqueeze.default", [rows, 1], {}, _meta((length, 1), torch.int64), no_grad)
        columns = converter.emit(f"{node.name}_columns", "aten.arange.default", [source], {"device": _device(node)}, _meta((source,), torch.int64), no_grad)
        mask = converter.emit(f"{node.name}_causal", "aten.ge.Tensor", [column, columns], {}, _meta((length, source), torch.bool), no_grad)
    if isinstance(mask, VTensor):
        if mask.tensor.dtype == "bool":
            scores = converter.emit(f"{node.name}_masked", "aten.where.ScalarOther", [mask, scores, -math.inf], {}, _meta(scores_shape, dtype), no_grad)
        else:
            scores = converter.emit(f"{node.name}_biased", "aten.add.Tensor", [scores, mask], {}, _meta(scores_shape, dtype), no_grad)
    weights = converter.emit(f"{node.name}_weights", "aten._softmax.default", [scores, -1, False], {}, _meta(scores_shape, dtype), no_grad)
    dropped, _ = _dropped(converter, node, weights, p, no_grad, name=f"{node.name}_dropout")
    output_shape = (*batch, length, value.shape[-1])
    return converter.emit(node.name, "aten.matmul.default", [dropped, value], {}, _meta(output_shape, dtype), no_grad)


RANDOM_HANDLERS: dict[str, Handler] = {
    "aten.dropout.default": _dropout,
    "aten.dropout_.default": _dropout,
    "aten.native_dropout.default": _native_dropout,
    "aten.bernoulli.default": _bernoulli,
    "aten.bernoulli.p": _bernoulli,
    "aten.bernoulli_.float": _bernoulli,
    "aten.bernoulli_.Tensor": _bernoulli,
    "aten.rand.default": _factory("uniform"),
    "aten.rand_like.default": _factory("uniform"),
    "aten.randn.default": _factory("normal"),
    "aten.randn_like.default": _factory("normal"),
    "aten.uniform_.default": _fill("uniform"),
    "aten.normal_.default": _fill("normal"),
    "aten.scaled_dot_product_attention.default": _attention,
}
"""Random ATen targets (in-place forms included: the converter writes their result back)."""
