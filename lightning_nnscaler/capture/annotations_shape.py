"""Annotations for shape ops (view, permute, cat, split, slice, index, ...) and tensor factories.

Ops whose constants encode sizes (``view``'s shape, ``expand``'s sizes, ``zeros``' size,
``arange``'s range) carry a ``rewrite`` that sets those constants from the piece's own shapes.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from lightning_nnscaler.capture.annotations import _broadcast, _names, _normalized_dims, _text
from lightning_nnscaler.capture.registry import register_annotation
from lightning_nnscaler.ir.op import Op
from lightning_nnscaler.ir.tensor import VTensor


def _set_argument(op: Op, position: int, keyword: str, value: Any) -> Op:
    if len(op.args) > position:
        return replace(op, args=op.args[:position] + (value,) + op.args[position + 1 :])
    return replace(op, kwargs=tuple((key, value if key == keyword else old) for key, old in op.kwargs))


def _shape_argument(position: int, keyword: str = "size") -> Callable[[Op], Op]:
    """A rewrite that sets one argument to the piece's output shape."""
    return lambda piece: _set_argument(piece, position, keyword, list(piece.outputs[0].shape))


def reshape_specs(in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> tuple[list[str], list[str]]:
    """Specs for a row-major reshape: dims that merge become ``(a b)``; regroupings are frozen."""
    fresh = _names()
    left: list[str] = []
    right: list[str] = []
    i = j = 0
    while i < len(in_shape) or j < len(out_shape):
        if i < len(in_shape) and in_shape[i] == 1:
            left.append("1")
            i += 1
            continue
        if j < len(out_shape) and out_shape[j] == 1:
            right.append("1")
            j += 1
            continue
        group_in, group_out = [i], [j]
        product_in, product_out = in_shape[i], out_shape[j]
        i, j = i + 1, j + 1
        while product_in != product_out:
            if product_in < product_out:
                product_in *= in_shape[i]
                group_in.append(i)
                i += 1
            else:
                product_out *= out_shape[j]
                group_out.append(j)
                j += 1
        if len(group_in) == 1 and len(group_out) == 1:
            name = next(fresh)
            left.append(name)
            right.append(name)
        elif len(group_in) == 1 or len(group_out) == 1:
            names = [next(fresh) for _ in range(max(len(group_in), len(group_out)))]
            merged = "(" + " ".join(names) + ")"
            (left.append(merged), right.extend(names)) if len(group_in) == 1 else (left.extend(names), right.append(merged))
        else:
            left.extend(next(fresh) + "^" for _ in group_in)
            right.extend(next(fresh) + "^" for _ in group_out)
    return left, right


def _reshape(op: Op) -> str:
    left, right = reshape_specs(op.tensor_inputs[0].shape, op.outputs[0].shape)
    return _text([left], [right], (0,))


register_annotation("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default", rewrite=_shape_argument(1, "size"))(_reshape)
register_annotation(
    "aten.flatten.using_ints", "aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default", "aten.unsqueeze.default"
)(_reshape)


def _unflatten_rewrite(piece: Op) -> Op:
    dim = int(piece.args[1]) % len(piece.tensor_inputs[0].shape)
    count = len(piece.args[2])
    return _set_argument(piece, 2, "sizes", list(piece.outputs[0].shape[dim : dim + count]))


register_annotation("aten.unflatten.int", rewrite=_unflatten_rewrite)(_reshape)


@register_annotation("aten.expand.default", rewrite=_shape_argument(1, "size"))
def _expand(op: Op) -> str:
    return _broadcast(op, value=(0,))


@register_annotation("aten.permute.default", "aten.transpose.int", "aten.t.default")
def _permute(op: Op) -> str:
    rank = len(op.tensor_inputs[0].shape)
    if op.target == "aten.permute.default":
        order = [int(dim) % rank for dim in op.args[1]]
    else:
        first, second = (int(op.args[1]) % rank, int(op.args[2]) % rank) if op.target == "aten.transpose.int" else (0, 1 % max(rank, 1))
        order = list(range(rank))
        order[first], order[second] = order[second], order[first]
    fresh = _names()
    names = [next(fresh) for _ in range(rank)]
    return _text([names], [[names[dim] for dim in order]], (0,))


def _with_frozen_dims(op: Op, frozen: set[int], value: tuple[int, ...] = (0,)) -> str:
    """One input and its outputs share names except the ``frozen`` dims, which differ and are ``^``."""
    fresh = _names()
    names = [next(fresh) for _ in op.tensor_inputs[0].shape]
    source = [name + "^" if dim in frozen else name for dim, name in enumerate(names)]
    outputs = []
    for output in op.outputs:
        outputs.append([next(fresh) + "^" if dim in frozen else name for dim, name in enumerate(names[: len(output.shape)])])
    return _text([source], outputs, value)


def _dim_argument(op: Op, position: int, default: int = 0) -> int:
    dim = op.args[position] if len(op.args) > position else op.kwargs_dict.get("dim", default)
    return int(dim) % max(len(op.tensor_inputs[0].shape), 1)


@register_annotation("aten.slice.Tensor", "aten.split.Tensor", "aten.split_with_sizes.default", "aten.roll.default")
def _cut_along_dims(op: Op) -> str:
    if op.target == "aten.roll.default":
        dims = op.args[2] if len(op.args) > 2 else op.kwargs_dict.get("dims", [])
    elif op.target == "aten.slice.Tensor":
        dims = _dim_argument(op, 1)
    else:
        dims = _dim_argument(op, 2)
    return _with_frozen_dims(op, set(_normalized_dims(dims, len(op.tensor_inputs[0].shape))))


register_annotation("aten.chunk.default")(lambda op: _with_frozen_dims(op, {_dim_argument(op, 2)}))


@register_annotation("aten.select.int", "aten.unbind.int")
def _select(op: Op) -> str:
    dim = _dim_argument(op, 1)
    fresh = _names()
    names = [next(fresh) for _ in op.tensor_inputs[0].shape]
    source = [name + "^" if index == dim else name for index, name in enumerate(names)]
    kept = [name for index, name in enumerate(names) if index != dim]
    return _text([source], [kept] * len(op.outputs), (0,))


@register_annotation("aten.cat.default", "aten.stack.default")
def _concatenate(op: Op) -> str:
    rank = len(op.outputs[0].shape)
    dim = int(op.args[1] if len(op.args) > 1 else op.kwargs_dict.get("dim", 0)) % rank
    fresh = _names()
    shared = [next(fresh) for _ in range(rank)]
    stacking = op.target == "aten.stack.default"
    inputs = []
    for piece in op.tensor_inputs:
        if stacking:
            inputs.append(shared[:dim] + shared[dim + 1 :])
        else:
            inputs.append(shared[:dim] + [next(fresh) + "^"] + shared[dim + 1 :])
    out = shared[:dim] + [("" if stacking else next(fresh)) + ("" if stacking else "^")] + shared[dim + 1 :]
    if stacking:
        out[dim] = str(len(inputs))
    return _text(inputs, [out], tuple(range(len(inputs))))


@register_annotation("aten.pad.default", "aten.constant_pad_nd.default")
def _pad(op: Op) -> str:
    rank = len(op.tensor_inputs[0].shape)
    widths = list(op.args[1])
    padded = {rank - 1 - index // 2 for index, width in enumerate(widths) if width}
    fill = op.args[3] if op.target == "aten.pad.default" and len(op.args) > 3 else (op.args[2] if len(op.args) > 2 else 0)
    return _with_frozen_dims(op, padded, (0,) if not fill else ())


@register_annotation("aten.index.Tensor")
def _index(op: Op) -> str | None:
    source = op.tensor_inputs[0]
    indices = list(op.args[1])
    positions = [dim for dim, index in enumerate(indices) if index is not None]
    if not positions or positions != list(range(positions[0], positions[-1] + 1)):
        return None  # non-adjacent advanced indices move dims to the front
    index_rank = len(op.outputs[0].shape) - (len(source.shape) - len(positions))
    fresh = _names()
    names = [next(fresh) for _ in source.shape]
    index_names = [next(fresh) for _ in range(index_rank)]
    spec = [name + "^" if dim in positions else name for dim, name in enumerate(names)]
    inputs = [spec]
    for index in indices:
        if isinstance(index, VTensor):
            offset = index_rank - len(index.shape)
            inputs.append([index_names[offset + i] if size != 1 else "1" for i, size in enumerate(index.shape)])
    out = names[: positions[0]] + index_names + names[positions[-1] + 1 :]
    return _text(inputs, [out], (0,))


# --- factories: no tensor inputs except as a template; sizes follow the piece ------------------------


def _factory(op: Op) -> str:
    fresh = _names()
    template = [[next(fresh) + "^" for _ in piece.shape] for piece in op.tensor_inputs]
    return _text(template, [[next(fresh) for _ in op.outputs[0].shape]])


register_annotation("aten.zeros.default", "aten.ones.default", "aten.empty.memory_format", "aten.full.default",
                    rewrite=_shape_argument(0))(_factory)
register_annotation("aten.new_zeros.default", "aten.new_ones.default", "aten.new_empty.default", "aten.new_full.default",
                    rewrite=_shape_argument(1))(_factory)


def _arange_rewrite(piece: Op) -> Op:
    args = list(piece.args)
    start, end, step = (0, args[0], 1) if piece.target == "aten.arange.default" else (args[0], args[1], args[2] if len(args) > 2 else 1)
    low, high = piece.outputs[0].index.ranges[0]
    return replace(piece, target="aten.arange.start_step", args=(start + low * step, start + high * step, step))


register_annotation("aten.arange.default", "aten.arange.start", "aten.arange.start_step", rewrite=_arange_rewrite)(_factory)
register_annotation("aten.scalar_tensor.default")(_factory)
