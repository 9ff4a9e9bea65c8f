"""Annotations for matmul-like and neural-network ops (linear, attention, norms, losses, conv)."""

from __future__ import annotations

import itertools
from dataclasses import replace

import torch

from lightning_nnscaler.ir.rules.common import _names, _text, argument, exact_value_inputs
from lightning_nnscaler.ir.rules.registry import register_annotation
from lightning_nnscaler.ir.op import Op
from lightning_nnscaler.ir.vocab import LOSS_FROM_PARTS_OP, VOCAB_EMBEDDING_OP, VOCAB_LOSS_PARTS_OP


def _batch_names(count: int, taken: str = "kmn") -> list[str]:
    return list(itertools.islice((name for name in _names() if name not in taken), count))


@register_annotation("aten.linear.default")
def _linear(op: Op) -> str:
    x, weight, *bias = op.tensor_inputs
    batch = _batch_names(len(x.shape) - 1)
    inputs = [batch + ["k+"], ["n", "k+"]] + ([["n"]] if bias else [])
    return _text(inputs, [batch + ["n"]], exact_value_inputs(op, (0, 2) if bias else (0,)))


@register_annotation("aten.mm.default")
def _mm(op: Op) -> str:
    return "m k+, k+ n -> m n; value 0"


@register_annotation("aten.bmm.default")
def _bmm(op: Op) -> str:
    return "b m k+, b k+ n -> b m n; value 0"


def _bias_spec(shape: tuple[int, ...], out_names: list[str], out_shape: tuple[int, ...]) -> list[str]:
    offset = len(out_shape) - len(shape)
    return [out_names[offset + i] if size == out_shape[offset + i] else "1" for i, size in enumerate(shape)]


@register_annotation("aten.addmm.default", "aten.baddbmm.default")
def _addmm(op: Op) -> str:
    bias, first, _ = op.tensor_inputs
    out = ["m", "n"] if op.target == "aten.addmm.default" else ["b", "m", "n"]
    left = out[:-1] + ["k+"]
    right = out[:-2] + ["k+", "n"]
    return _text([_bias_spec(bias.shape, out, op.outputs[0].shape), left, right], [out], exact_value_inputs(op, (0, 1)))


@register_annotation("aten.matmul.default")
def _matmul(op: Op) -> str | None:
    left, right = op.tensor_inputs
    if len(left.shape) < 2 or len(right.shape) < 2:
        return None
    out_shape = op.outputs[0].shape
    batch = _batch_names(len(out_shape) - 2)
    out = batch + ["m", "n"]
    left_batch = _bias_spec(left.shape[:-2], batch, out_shape[:-2])
    right_batch = _bias_spec(right.shape[:-2], batch, out_shape[:-2])
    return _text([left_batch + ["m", "k+"], right_batch + ["k+", "n"]], [out], exact_value_inputs(op, (0,)))


@register_annotation("aten.scaled_dot_product_attention.default")
def _attention(op: Op) -> str | None:
    query, key, value, *mask = op.tensor_inputs
    if len(query.shape) != 4 or key.shape[1] != query.shape[1]:
        return None  # grouped-query attention or unbatched: heads do not line up
    is_causal = op.args[5] if len(op.args) > 5 else op.kwargs_dict.get("is_causal", False)
    # Causal masking aligns query row i with key i, so only whole query ranges stay correct.
    rows = "l^" if is_causal else "l"
    inputs = [["b", "h", rows, "e^"], ["b", "h", "s^", "e^"], ["b", "h", "s^", "f"]]
    if mask:
        inputs.append(_bias_spec(mask[0].shape, ["b", "h", "l", "s"], (*query.shape[:3], key.shape[2])))
    # The output is linear in the values (softmax(q k^T) v): a value split of v is exact.
    return _text(inputs, [["b", "h", "l", "f"]], exact_value_inputs(op, (2,)))


def _vocabulary_slice(piece: Op) -> Op:
    """A piece whose table holds only some vocabulary rows becomes a ``lnn.vocab_embedding`` of that slice."""
    table, ids = piece.args[0], piece.args[1]
    start, stop = piece.tensor_inputs[0].index.ranges[0]
    if piece.target == VOCAB_EMBEDDING_OP:
        return replace(piece, args=(table, ids, start, piece.args[3]))
    if (start, stop) == (0, piece.tensor_inputs[0].tensor.shape[0]):
        return piece
    padding = argument(piece, 2, "padding_idx", -1)
    return replace(piece, target=VOCAB_EMBEDDING_OP, args=(table, ids, start, -1 if padding is None else padding), kwargs=())


def _plain_lookup(op: Op) -> bool:
    """An embedding without frequency scaling or sparse gradients (``lnn.vocab_embedding`` has neither)."""
    if op.target == VOCAB_EMBEDDING_OP:
        return True
    return not argument(op, 3, "scale_grad_by_freq", False) and not argument(op, 4, "sparse", False)


@register_annotation("aten.embedding.default", VOCAB_EMBEDDING_OP, rewrite=_vocabulary_slice)
def _embedding(op: Op) -> str:
    _, indices = op.tensor_inputs
    index_names = _batch_names(len(indices.shape), taken="vd")
    # Splitting the vocabulary rows leaves value parts: each slice looks up its own ids, zeros elsewhere.
    vocabulary = "v+" if _plain_lookup(op) else "v^"
    return _text([[vocabulary, "d"], index_names], [index_names + ["d"]], exact_value_inputs(op, (0,)))


@register_annotation("aten.layer_norm.default")
def _layer_norm(op: Op) -> str:
    x, *affine = op.tensor_inputs
    normalized = len(op.args[1])
    batch = _batch_names(len(x.shape) - normalized, taken="")
    features = [f"f{i}^" for i in range(normalized)]
    return _text([batch + features] + [features] * len(affine), [batch + features])


def _loss_parts_columns(piece: Op) -> Op:
    """A piece over some vocabulary columns adds up only those: its ``start`` is its first column."""
    logits, row_sums, targets, _, vocabulary = piece.args
    return replace(piece, args=(logits, row_sums, targets, piece.tensor_inputs[0].index.ranges[1][0], vocabulary))


@register_annotation(VOCAB_LOSS_PARTS_OP, rewrite=_loss_parts_columns)
def _vocab_loss_parts(op: Op) -> str:
    # Columns are a sum: a slice of them gives value parts of both sums (ir.vocab).
    return "n c+, n, n -> n 2"


@register_annotation(LOSS_FROM_PARTS_OP)
def _loss_from_parts(op: Op) -> str:
    return "n+ 2, n+, n+ -> ()"


@register_annotation("aten.cross_entropy_loss.default", "aten.nll_loss_nd.default", "aten.nll_loss.default")
def _classification_loss(op: Op) -> str | None:
    logits, target, *weight = op.tensor_inputs
    reduction = op.args[3] if len(op.args) > 3 else op.kwargs_dict.get("reduction", 1)
    if reduction == 1 or len(logits.shape) < 2:
        return None  # a mean needs the global count: capture rewrites it into sum / count
    mark = "+" if reduction == 2 else ""
    extra = [f"d{i}{mark}" for i in range(len(logits.shape) - 2)]
    inputs = [["n" + mark, "c^"] + extra, ["n" + mark] + extra] + [["c^"]] * len(weight)
    out = [] if reduction == 2 else ["n"] + extra
    return _text(inputs, [out])


POINTWISE_LOSSES = {
    "aten.mse_loss.default": 2, "aten.l1_loss.default": 2, "aten.smooth_l1_loss.default": 2, "aten.huber_loss.default": 2,
    "aten.binary_cross_entropy.default": 3, "aten.binary_cross_entropy_with_logits.default": 4,
}
"""Losses computed element by element, then reduced: target -> position of ``reduction`` (0 none, 1 mean, 2 sum)."""


@register_annotation(*POINTWISE_LOSSES)
def _pointwise_loss(op: Op) -> str | None:
    reduction = argument(op, POINTWISE_LOSSES[op.target], "reduction", 1)
    if reduction not in (0, 2):
        return None  # a mean needs the global count: capture rewrites it into sum / count
    shape = tuple(torch.broadcast_shapes(*(piece.shape for piece in op.tensor_inputs)))
    fresh = _names()
    names = [next(fresh) + ("+" if reduction == 2 else "") for _ in shape]
    inputs = []
    for piece in op.tensor_inputs:
        offset = len(shape) - len(piece.shape)
        inputs.append([names[offset + i] if size == shape[offset + i] else "1" for i, size in enumerate(piece.shape)])
    return _text(inputs, [[] if reduction == 2 else names])


def _depthwise_groups(piece: Op) -> Op:
    """A piece of a depthwise conv over some of its channels has one group per channel it holds."""
    groups = int(argument(piece, 6, "groups", 1))
    x, weight = piece.tensor_inputs[:2]
    if groups == 1 or len(x.shape) != len(weight.shape) or groups != x.tensor.shape[1]:
        return piece
    if len(piece.args) > 6:
        return replace(piece, args=piece.args[:6] + (x.shape[1],) + piece.args[7:])
    return replace(piece, kwargs=tuple((key, x.shape[1] if key == "groups" else value) for key, value in piece.kwargs))


@register_annotation("aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default", rewrite=_depthwise_groups)
def _convolution(op: Op) -> str:
    x, weight, *bias = op.tensor_inputs
    groups = int(argument(op, 6, "groups", 1))
    spatial = len(x.shape) - 2
    if len(x.shape) != len(weight.shape):
        return _text([[f"x{d}^" for d in range(len(x.shape))], [f"w{d}^" for d in range(len(weight.shape))]] + [["o^"]] * len(bias),
                     [[f"y{d}^" for d in range(len(op.outputs[0].shape))]])  # unbatched: nothing to cut
    window = [f"w{d}^" for d in range(spatial)]
    if groups == 1:
        channels_in, channels_out, kernel_in = "c+", "o", "c+"
    elif groups == x.shape[1] == weight.shape[0]:
        channels_in = channels_out = "c"  # depthwise (ConvNeXt, MobileNet): channel c reads only channel c
        kernel_in = "1"
    else:
        channels_in, channels_out, kernel_in = "c^", "o^", "k^"  # grouped: the batch still splits
    inputs = [["n", channels_in] + [f"i{d}^" for d in range(spatial)], [channels_out, kernel_in] + window]
    inputs += [[channels_out]] * len(bias)
    return _text(inputs, [["n", channels_out] + [f"j{d}^" for d in range(spatial)]], exact_value_inputs(op, (0, 2) if bias else (0,)))
