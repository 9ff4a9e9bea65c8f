"""Capture q, k and v packed in one projection as one projection per part, so tensor parallelism splits them by heads.

Models pack q, k and v in one weight and take the product apart afterwards:

- nanoGPT: ``q, k, v = c_attn(x).split(E, dim=2)`` (``split_with_sizes`` for grouped-query packs);
- Hugging Face GPT-2: its ``Conv1D`` is ``addmm(b, x.view(-1, E), W).view(B, T, 3E)``, ``W`` is ``(E, 3E)``, then ``.split(E, dim=2)``;
- timm's ViT: ``qkv(x).reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)``.

A split of the packed output features mixes q, k and v, and the part index is the outer factor of
``(3 H D)``, so no split of that one linear gives each rank whole heads of all three. `split_packed_qkv`
rewrites the exported graph (before conversion) so that part ``i`` is its own projection reading the
weight's ``i``-th box of output features, ``W.split(sizes, dim)[i]`` (which the capture holds as a
box of the parameter, not an op: ``convert._decompose_parameter_split``), followed by the same view
and permutation the part had. A column split of each then holds whole heads of q, k and v, and their
gradients land in those boxes of the one packed parameter, whose ``state_dict`` key is unchanged.
(PyTorch's ``nn.MultiheadAttention`` packs differently and is handled in ``capture.packed``.)
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from lightning_nnscaler.capture.packed import _only_user, _shape

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default)


@dataclass(frozen=True)
class PackedParts:
    """A projection whose output features are read only as consecutive parts, and how each part is shaped."""

    projection: fx.Node
    """``linear(x, W, b)`` (``W``: ``(out, in)``) or ``addmm(b, x, W)`` (``W``: ``(in, out)``)."""
    sizes: tuple[int, ...]
    """Output features of each part, in order."""
    parts: tuple[fx.Node, ...]
    """The node each part's value replaces (a ``getitem`` of a split or an unbind, or a ``select``)."""
    lead: tuple[int, ...] | None
    """For GPT-2's ``addmm``: the leading dims it views its ``(B·T, 3E)`` result back to; else None."""
    heads: tuple[int, ...] | None
    """For timm's reshape: each part's ``(H, D)``; its view is ``(*lead, H, D)`` then ``order``."""
    order: tuple[int, ...] | None


def split_packed_qkv(exported: ExportedProgram) -> ExportedProgram:
    """Rewrite every packed q/k/v projection of ``exported`` (in place) into one projection per part; returns it."""
    graph = exported.graph
    parameters = {node for node in graph.nodes if node.op == "placeholder" and _kind(exported, node) == InputKind.PARAMETER}
    found = [packed for node in list(graph.nodes) if (packed := _packed(node, parameters)) is not None]
    for packed in found:
        _rewrite(graph, packed)
        _erase_unread(graph, packed)
    if found:
        graph.lint()
        exported.graph_module.recompile()
    return exported


def _erase_unread(graph: fx.Graph, packed: PackedParts) -> None:
    """Erase the packed projection and the chain that took it apart, now that nothing reads them (only those:
    a general dead-code pass could drop in-place updates of buffers)."""
    chain = [packed.projection]
    while len(chain[-1].users) == 1 and chain[-1] not in packed.parts:
        chain.append(next(iter(chain[-1].users)))
    chain += [user for user in chain[-1].users if user in packed.parts]
    for node in reversed(chain):
        if not node.users:
            graph.erase_node(node)


def _kind(exported: ExportedProgram, node: fx.Node) -> InputKind | None:
    spec = next((spec for spec in exported.graph_signature.input_specs if getattr(spec.arg, "name", None) == node.name), None)
    return None if spec is None else spec.kind


def _packed(node: fx.Node, parameters: set[fx.Node]) -> PackedParts | None:
    """The packing read after ``node``, if ``node`` is a projection with parameter weight and bias."""
    if node.op != "call_function" or node.target not in (aten.linear.default, aten.addmm.default):
        return None
    if node.target is aten.linear.default:
        weight, bias = node.args[1], node.args[2] if len(node.args) > 2 else None
    else:
        bias, weight = node.args[0], node.args[2]
        if len(node.args) > 3 or node.kwargs:
            return None  # beta / alpha scale the product
    if weight not in parameters or (bias is not None and bias not in parameters):
        return None
    after, lead = _only_user(node), None
    if node.target is aten.addmm.default:
        if after is None or after.target not in _VIEWS or _shape(after)[-1] != _shape(node)[-1]:
            return None
        lead, after = _shape(after)[:-1], _only_user(after)
    if after is None:
        return None
    features = _shape(node)[-1]
    if after.target in _SPLITS:
        return _split_parts(node, after, features, lead)
    if after.target in _VIEWS and lead is None:
        return _reshaped_parts(node, after, features)
    return None


def _split_parts(projection: fx.Node, split: fx.Node, features: int, lead: tuple[int, ...] | None) -> PackedParts | None:
    """``y.split(sizes, dim=-1)`` read only through its items."""
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    rank = len(_shape(split.args[0]))
    if int(dim) % rank != rank - 1:
        return None
    sizes = split.args[1]
    if isinstance(sizes, int):
        sizes = [min(sizes, features - start) for start in range(0, features, sizes)]
    parts = _items(split, len(sizes))
    if parts is None or len(sizes) < 2:
        return None
    return PackedParts(projection, tuple(int(size) for size in sizes), parts, lead, None, None)


def _reshaped_parts(projection: fx.Node, reshape: fx.Node, features: int) -> PackedParts | None:
    """``y.reshape(*lead, n, H, D)[.permute(...)]`` read only through ``unbind`` / ``select`` of the ``n`` dim."""
    lead = _shape(projection)[:-1]
    shape = _shape(reshape)
    if len(shape) != len(lead) + 3 or shape[: len(lead)] != lead:
        return None
    count, heads, head_size = shape[len(lead) :]
    packed_axis, order = len(lead), tuple(range(len(shape)))
    after = _only_user(reshape)
    if after is not None and after.target is aten.permute.default:
        order = tuple(int(dim) % len(shape) for dim in after.args[1])
        reshape, after = after, _only_user(after)
    taken_at = order.index(packed_axis)
    parts: tuple[fx.Node, ...] | None = None
    if after is not None and after.target is aten.unbind.int and int(after.args[1] if len(after.args) > 1 else 0) % len(shape) == taken_at:
        parts = _items(after, count)
    else:
        selects = list(reshape.users)
        indices = [int(select.args[2]) % count for select in selects if select.target is aten.select.int and int(select.args[1]) % len(shape) == taken_at]
        if len(indices) == len(selects) == count and sorted(indices) == list(range(count)):
            parts = tuple(sorted(selects, key=lambda select: int(select.args[2]) % count))
    if parts is None or count < 2:
        return None
    part_order = tuple(dim - (dim > packed_axis) for dim in order if dim != packed_axis)
    return PackedParts(projection, (heads * head_size,) * count, parts, lead, (heads, head_size), part_order)


def _items(node: fx.Node, count: int) -> tuple[fx.Node, ...] | None:
    """The ``getitem`` users of a multi-output node, one per index ``0 .. count-1`` (unused items may be missing: None)."""
    by_index: dict[int, fx.Node] = {}
    for user in node.users:
        if user.target is not operator.getitem or user.args[1] in by_index:
            return None
        by_index[int(user.args[1])] = user
    if not by_index or any(index >= count for index in by_index):
        return None
    return tuple(by_index.get(index) for index in range(count))  # type: ignore[misc]


def _rewrite(graph: fx.Graph, packed: PackedParts) -> None:
    node = packed.projection
    linear = node.target is aten.linear.default
    source, weight, bias = (node.args[0], node.args[1], node.args[2] if len(node.args) > 2 else None) if linear else node.args[1:3] + (node.args[0],)
    sizes = list(packed.sizes)
    with graph.inserting_before(node):
        weights = _call(graph, aten.split_with_sizes.default, (weight, sizes, 0 if linear else 1))
        biases = _call(graph, aten.split_with_sizes.default, (bias, sizes, 0)) if bias is not None else None
        for index, part in enumerate(packed.parts):
            if part is None:
                continue  # a part nobody reads
            part_weight = _call(graph, operator.getitem, (weights, index))
            part_bias = _call(graph, operator.getitem, (biases, index)) if biases is not None else None
            name = f"{node.name}_{'qkv'[index] if len(sizes) == 3 else index}"
            if linear:
                value = _call(graph, aten.linear.default, (source, part_weight) + ((part_bias,) if part_bias is not None else ()), name)
            else:
                value = _call(graph, aten.addmm.default, (part_bias, source, part_weight), name)
            if packed.heads is not None:
                value = _call(graph, aten.view.default, (value, [*packed.lead, *packed.heads]))
                value = _call(graph, aten.permute.default, (value, list(packed.order)))
            elif packed.lead is not None:
                value = _call(graph, aten.view.default, (value, [*packed.lead, sizes[index]]))
            part.replace_all_uses_with(value)


def _call(graph: fx.Graph, target: Any, args: tuple[Any, ...], name: str | None = None) -> fx.Node:
    """A new node whose ``meta["val"]`` is ``target`` run on its inputs' fake values."""
    node = graph.create_node("call_function", target, args, name=name)
    node.meta["val"] = target(*fx.node.map_arg(args, lambda argument: argument.meta["val"]))
    return node
