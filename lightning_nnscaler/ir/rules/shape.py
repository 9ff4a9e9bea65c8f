"""Annotations for shape ops (view, permute, cat, split, slice, index, ...) and tensor factories.

Ops whose constants encode sizes (``view``'s shape, ``expand``'s sizes, ``zeros``' size,
``arange``'s range) carry a ``rewrite`` that sets those constants from the piece's own shapes.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from lightning_nnscaler.ir.rules.common import _broadcast, _names, _normalized_dims, _text, argument, exact_value_inputs
from lightning_nnscaler.ir.rules.registry import register_annotation
from lightning_nnscaler.ir.op import Op
from lightning_nnscaler.ir.randomness import RANDOM_LIKE_OP, RANDOM_OP
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
    return _text([left], [right], exact_value_inputs(op, (0,)))


register_annotation("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default", rewrite=_shape_argument(1, "size"))(_reshape)
register_annotation("aten.flatten.using_ints", "aten.unsqueeze.default")(_reshape)


def _squeeze_rewrite(piece: Op) -> Op:
    """Squeeze only the dims of size 1 in the whole tensor: a split may leave a piece's dim at size 1."""
    whole = piece.tensor_inputs[0].tensor.shape
    requested = None if piece.target == "aten.squeeze.default" else argument(piece, 1, "dim", None)
    dims = [dim for dim in _normalized_dims(requested, len(whole)) if whole[dim] == 1]
    return replace(piece, target="aten.squeeze.dims", args=(piece.args[0], dims), kwargs=())


register_annotation("aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default", rewrite=_squeeze_rewrite)(_reshape)


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
    return _text([names], [[names[dim] for dim in order]], exact_value_inputs(op, (0,)))


def _with_frozen_dims(op: Op, frozen: set[int], value: tuple[int, ...] = (0,)) -> str:
    """One input and its outputs share names except the ``frozen`` dims, which differ and are ``^``."""
    fresh = _names()
    names = [next(fresh) for _ in op.tensor_inputs[0].shape]
    source = [name + "^" if dim in frozen else name for dim, name in enumerate(names)]
    outputs = []
    for output in op.outputs:
        outputs.append([next(fresh) + "^" if dim in frozen else name for dim, name in enumerate(names[: len(output.shape)])])
    return _text([source], outputs, exact_value_inputs(op, value))


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


@register_annotation("aten.flip.default")
def _flip(op: Op) -> str:
    # A flipped dim maps index i to size-1-i: a piece of it reads the mirrored piece of the input.
    return _with_frozen_dims(op, set(_normalized_dims(argument(op, 1, "dims", []), len(op.tensor_inputs[0].shape))))


@register_annotation("aten.select.int", "aten.unbind.int")
def _select(op: Op) -> str:
    dim = _dim_argument(op, 1)
    fresh = _names()
    names = [next(fresh) for _ in op.tensor_inputs[0].shape]
    source = [name + "^" if index == dim else name for index, name in enumerate(names)]
    kept = [name for index, name in enumerate(names) if index != dim]
    return _text([source], [kept] * len(op.outputs), exact_value_inputs(op, (0,)))


@register_annotation("aten.cat.default", "aten.stack.default")
def _concatenate(op: Op) -> str:
    rank = len(op.outputs[0].shape)
    dim = int(op.args[1] if len(op.args) > 1 else op.kwargs_dict.get("dim", 0)) % rank
    fresh = _names()
    shared = [next(fresh) for _ in range(rank)]
    stacking = op.target == "aten.stack.default"
    inputs = []
    # torch.cat skips a 1-D empty tensor next to tensors of any rank (Hugging Face's empty key/value caches): nothing to cut.
    skipped = {position for position, piece in enumerate(op.tensor_inputs) if not stacking and rank > 1 and piece.shape == (0,)}
    for position, piece in enumerate(op.tensor_inputs):
        if position in skipped:
            inputs.append([next(fresh) + "^"])
        elif stacking:
            inputs.append(shared[:dim] + shared[dim + 1 :])
        else:
            inputs.append(shared[:dim] + [next(fresh) + "^"] + shared[dim + 1 :])
    out = shared[:dim] + [("" if stacking else next(fresh)) + ("" if stacking else "^")] + shared[dim + 1 :]
    if stacking:
        out[dim] = str(len(inputs))
    return _text(inputs, [out], exact_value_inputs(op, tuple(position for position in range(len(inputs)) if position not in skipped)))


@register_annotation("aten.pad.default", "aten.constant_pad_nd.default")
def _pad(op: Op) -> str:
    rank = len(op.tensor_inputs[0].shape)
    widths = list(op.args[1])
    padded = {rank - 1 - index // 2 for index, width in enumerate(widths) if width}
    if op.target == "aten.pad.default":
        mode, fill = argument(op, 2, "mode", "constant"), argument(op, 3, "value", None)
    else:
        mode, fill = "constant", argument(op, 2, "value", 0)
    # Reflect/replicate/circular padding copies elements (linear); a constant fill is linear only if 0.
    linear = mode != "constant" or not fill
    return _with_frozen_dims(op, padded, (0,) if linear else ())


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
    # The index tensors broadcast together; a dim of size 1 in all of them stays "1" in the result.
    index_names = [next(fresh) for _ in range(index_rank)]
    broadcast = [1] * index_rank
    spec = [name + "^" if dim in positions else name for dim, name in enumerate(names)]
    inputs = [spec]
    for index in indices:
        if isinstance(index, VTensor):
            offset = index_rank - len(index.shape)
            inputs.append([index_names[offset + i] if size != 1 else "1" for i, size in enumerate(index.shape)])
            for i, size in enumerate(index.shape):
                broadcast[offset + i] = max(broadcast[offset + i], size)
    index_out = [name if size != 1 else "1" for name, size in zip(index_names, broadcast)]
    out = names[: positions[0]] + index_out + names[positions[-1] + 1 :]
    return _text(inputs, [out], exact_value_inputs(op, (0,)))


@register_annotation("aten.gather.default")
def _gather(op: Op) -> str:
    # out[i][j] = self[i][index[i][j]] (dim=1): the result has index's shape. Other dims pair up
    # position by position only where index and self have the same size there.
    source, index = op.tensor_inputs
    dim = _dim_argument(op, 1)
    fresh = _names()
    source_spec, index_spec = [], []
    for axis, (source_size, index_size) in enumerate(zip(source.shape, index.shape)):
        if axis == dim:
            source_spec.append(next(fresh) + "^")
            index_spec.append(next(fresh))
        elif source_size == index_size:
            name = next(fresh)
            source_spec.append(name)
            index_spec.append(name)
        else:
            source_spec.append(next(fresh) + "^")
            index_spec.append(next(fresh) + "^")
    return _text([source_spec, index_spec], [index_spec], exact_value_inputs(op, (0,)))


def _joined_along(op: Op, dim: int, value: tuple[int, ...]) -> str:
    """Tensors of one rank that meet along ``dim``: every other dim is shared, ``dim`` is frozen per tensor."""
    rank = len(op.outputs[0].shape)
    fresh = _names()
    shared = [next(fresh) for _ in range(rank)]

    def spec() -> list[str]:
        return shared[:dim] + [next(fresh) + "^"] + shared[dim + 1 :]

    return _text([spec() for _ in op.tensor_inputs], [spec()], exact_value_inputs(op, value))


@register_annotation("aten.diff.default")
def _diff(op: Op) -> str:
    # diff(x, n, dim, prepend, append) is linear in x, prepend and append jointly.
    dim = int(argument(op, 2, "dim", -1)) % len(op.outputs[0].shape)
    return _joined_along(op, dim, tuple(range(len(op.tensor_inputs))))


@register_annotation("aten.slice_scatter.default")
def _slice_scatter(op: Op) -> str:
    # self with self[dim][start:end:step] replaced by src: linear in (self, src) jointly.
    return _joined_along(op, _dim_argument(op, 2), (0, 1))


@register_annotation("aten.select_scatter.default")
def _select_scatter(op: Op) -> str:
    # self with self.select(dim, index) replaced by src (which lacks dim): linear in (self, src) jointly.
    dim = _dim_argument(op, 2)
    fresh = _names()
    names = [next(fresh) for _ in op.tensor_inputs[0].shape]
    source = [name + "^" if axis == dim else name for axis, name in enumerate(names)]
    written = [name for axis, name in enumerate(names) if axis != dim]
    out = [next(fresh) + "^" if axis == dim else name for axis, name in enumerate(names)]
    return _text([source, written], [out], exact_value_inputs(op, (0, 1)))


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


def _box_offsets(piece: Op, offset: list[int]) -> list[int]:
    return [start + low for start, (low, _) in zip(offset, piece.outputs[0].index.ranges)]


def _random_rewrite(piece: Op) -> Op:
    """A piece of a random factory draws its own box of the full tensor (``ir.randomness``)."""
    _, offset, *rest = piece.args
    return replace(piece, args=(list(piece.outputs[0].shape), _box_offsets(piece, offset), *rest))


def _random_like_rewrite(piece: Op) -> Op:
    """A piece of a random op shaped like its template draws its own box of the full tensor."""
    template, offset, *rest = piece.args
    return replace(piece, args=(template, _box_offsets(piece, offset), *rest))


@register_annotation(RANDOM_LIKE_OP, rewrite=_random_like_rewrite)
def _random_like(op: Op) -> str:
    # Only the template's shape is read: the output follows its dims, no value flows.
    fresh = _names()
    names = [next(fresh) for _ in op.outputs[0].shape]
    return _text([names], [names])


register_annotation(RANDOM_OP, rewrite=_random_rewrite)(_factory)
