"""Capture-time rewrites that let tensor parallelism split PyTorch's own attention by heads.

``nn.MultiheadAttention`` (and the ``nn.Transformer*Layer`` built on it) packs q, k and v in one
``in_proj_weight`` ``[3E, E]`` and ``F.multi_head_attention_forward`` writes its heads as
``(L, B·H, D)`` views. Neither form can be cut by heads: a split of the packed rows mixes q, k and v,
and ``B·H`` puts the heads in the inner factor of a merged dim. Two exact rewrites fix that:

- `packed_projections`: ``linear(x, W, b).unflatten(-1, (n, E)).unsqueeze(0).transpose(0, -2)
  .squeeze(-2).contiguous()[i]`` becomes ``linear(x, W[iE:(i+1)E], b[iE:(i+1)E])``: ``n`` linears,
  each reading its box of the packed parameters (no op cuts it out; nor does a ``split`` of a
  parameter's rows, as in cross-attention's ``w_q, w_kv = w.split([E, 2E])``), so a split by output features
  gives each rank exactly its heads' rows of q, k and v, and their gradients land in those rows.
- `head_views`: ``x.view(L, B·H, D).transpose(0, 1).view(B, H, L, D)`` becomes
  ``x.view(L, B, H, D).permute(1, 2, 0, 3)``: the same tensor, with the heads a dim of their own.
- `flattened_linears`: the output projection's ``x.reshape(L·B, E)`` → ``linear`` → ``.view(L, B, O)``
  becomes ``linear(x.reshape(L, B, E))``: a linear acts on the last dim alone, so keeping the
  leading dims apart computes the same, and the batch stays a dim of its own (``L·B`` puts it in
  the inner factor of a merged dim, which no microbatch or replica split can cut).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
from torch import fx

LINEAR = torch.ops.aten.linear.default
_UNPACK_CHAIN = (
    (torch.ops.aten.unsqueeze.default, (0,)),
    (torch.ops.aten.transpose.int, (0, -2)),
    (torch.ops.aten.squeeze.dim, (-2,)),
)
_CONTIGUOUS = torch.ops.aten.contiguous.default
_SELECT = torch.ops.aten.select.int
_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default)
_TRANSPOSE = torch.ops.aten.transpose.int


@dataclass(frozen=True)
class PackedProjection:
    """A linear over ``parts`` projections packed in one weight, read only as its parts."""

    linear: fx.Node
    parts: tuple[fx.Node, ...]
    """The node that is part ``i`` (a ``select`` of the unpacked stack), per ``i``."""
    size: int
    """Output features of each part (``E``)."""
    skipped: tuple[fx.Node, ...]
    """The unflatten-to-select chain between them, which the rewrite makes dead."""


@dataclass(frozen=True)
class HeadView:
    """``view(L, B·H, D) -> transpose(0, 1) -> view(B, H, L, D)`` of a ``(L, B, H·D)`` tensor."""

    first: fx.Node
    last: fx.Node
    heads_shape: tuple[int, int, int, int]
    """``(L, B, H, D)``: the shape of the view that replaces the first one."""
    skipped: tuple[fx.Node, ...]


@dataclass(frozen=True)
class FlattenedLinear:
    """``reshape(x, (N, E)) -> linear -> view(*lead, O)`` where ``x`` is ``(*lead, *tail)``, ``N = prod(lead)``."""

    first: fx.Node
    linear: fx.Node
    last: fx.Node
    kept_shape: tuple[int, ...]
    """``(*lead, E)``: the shape of the reshape that replaces the first one."""
    skipped: tuple[fx.Node, ...]


def _only_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _is_call(node: fx.Node | None, target: object, args: tuple = ()) -> bool:
    if node is None or node.op != "call_function" or node.target is not target:
        return False
    return tuple(node.args[1:]) == args if args else True


def _shape(node: fx.Node) -> tuple[int, ...]:
    return tuple(int(size) for size in node.meta["val"].shape)


def packed_projections(graph: fx.Graph, parameters: set[fx.Node]) -> list[PackedProjection]:
    """Every linear whose weight (and bias) are parameters read only through the unpacking of
    ``F.multi_head_attention_forward``'s ``_in_projection_packed``."""
    found = []
    for node in graph.nodes:
        if not _is_call(node, LINEAR) or not _parameter_rows(node.args[1], parameters):
            continue
        bias = node.args[2] if len(node.args) > 2 else None
        if bias is not None and not _parameter_rows(bias, parameters):
            continue
        projection = _unpacked(node)
        if projection is not None:
            found.append(projection)
    return found


def _parameter_rows(node: fx.Node, parameters: set[fx.Node]) -> bool:
    """Whether ``node`` is a parameter, or rows of one split off along dim 0 (which the capture holds as a box)."""
    if node in parameters:
        return True
    split = node.args[0] if node.target is operator.getitem else None
    if not isinstance(split, fx.Node) or split.target not in (torch.ops.aten.split_with_sizes.default, torch.ops.aten.split.Tensor):
        return False
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    return split.args[0] in parameters and int(dim) % len(_shape(split.args[0])) == 0


def _unpacked(linear: fx.Node) -> PackedProjection | None:
    unflatten = _only_user(linear)
    if not _is_call(unflatten, torch.ops.aten.unflatten.int) or int(unflatten.args[1]) not in (-1, len(_shape(linear)) - 1):
        return None
    count, size = (int(item) for item in unflatten.args[2])
    chain, current = [unflatten], unflatten
    for target, args in _UNPACK_CHAIN:
        current = _only_user(current)
        if not _is_call(current, target, args):
            return None
        chain.append(current)
    stacked = current
    if _is_call(_only_user(current), _CONTIGUOUS):
        stacked = _only_user(current)
        chain.append(stacked)
    selects = list(stacked.users)
    if not selects or not all(_is_call(select, _SELECT) and int(select.args[1]) == 0 for select in selects):
        return None
    by_index: dict[int, list[fx.Node]] = {}
    for select in selects:
        by_index.setdefault(int(select.args[2]) % count, []).append(select)
    if sorted(by_index) != list(range(count)) or any(len(nodes) != 1 for nodes in by_index.values()):
        return None
    return PackedProjection(linear, tuple(by_index[index][0] for index in range(count)), size, tuple(chain))


def head_views(graph: fx.Graph) -> list[HeadView]:
    """Every ``(L, B, H·D) -> (L, B·H, D) -> (B·H, L, D) -> (B, H, L, D)`` chain of views."""
    found = []
    for node in graph.nodes:
        if not any(_is_call(node, view) for view in _VIEWS):
            continue
        source, merged = _shape(node.args[0]), _shape(node)
        transpose = _only_user(node)
        last = _only_user(transpose) if _is_call(transpose, _TRANSPOSE) else None
        if last is None or {int(dim) % 3 for dim in transpose.args[1:]} != {0, 1} or len(source) != 3 or len(merged) != 3:
            continue
        if not any(_is_call(last, view) for view in _VIEWS):
            continue
        batch_heads = _shape(last)
        if len(batch_heads) != 4:
            continue
        length, batch, heads, head_size = source[0], source[1], batch_heads[1], merged[2]
        if merged != (length, batch * heads, head_size) or batch_heads != (batch, heads, length, head_size) or source[2] != heads * head_size:
            continue
        found.append(HeadView(node, last, (length, batch, heads, head_size), (transpose, last)))
    return found


def flattened_linears(graph: fx.Graph) -> list[FlattenedLinear]:
    """Every reshape to 2-D that merges leading dims only for one linear whose output is viewed back to them."""
    found = []
    for node in graph.nodes:
        if not any(_is_call(node, view) for view in _VIEWS) or not isinstance(node.args[0], fx.Node):
            continue
        linear = _only_user(node)
        last = _only_user(linear) if _is_call(linear, LINEAR) and linear.args[0] is node else None
        if last is None or not any(_is_call(last, view) for view in _VIEWS):
            continue
        source, flat, out = _shape(node.args[0]), _shape(node), _shape(last)
        lead = out[:-1]
        if len(flat) != 2 or len(lead) < 2 or source[: len(lead)] != lead or math.prod(lead) != flat[0] or _shape(linear) != (flat[0], out[-1]):
            continue
        found.append(FlattenedLinear(node, linear, last, (*lead, flat[1]), (node, last)))
    return found
