"""Megatron-LM tensor parallelism (Shoeybi et al. 2019): column-split a linear, row-split the next one.

A linear whose input arrives whole is split by its output features ``n`` (column parallel). The split
flows through elementwise ops, head views ``(c d)``, transposes and attention (heads ``h``) until
it reaches the next linear on its reduction dim ``k``: that one is split by rows, its outputs are
partial sums (its bias is value-split, so it is added once) and the walk stops there; the
materialization adds the all-reduce. Everything else (embeddings, LayerNorms, residual adds) is
replicated. A final linear (LM head, classifier: no linear downstream) is never column-split by
vocabulary or class, since the cross-entropy after it needs whole logits anyway: it stays whole,
unless its input arrives split (an MLP ``Linear -> act -> Linear`` ending in a classifier loss),
then it is that pair's row-split linear, whose all-reduced output is whole logits again. Convs,
pools and other non-linears start no split: a conv stem before such an MLP stays replicated, so
that the MLP, not the conv, is the column/row pair. Where the parts do not divide a dim the split
needs (4 heads into 3, an FFN of 128 into 3), the op is left whole and the walk records a refusal:
``parallelize`` then raises (or warns, with ``allow_partial``), see ``plans.coverage``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir.op import Op
from lightning_nnscaler.plans.context import PlanContext
from lightning_nnscaler.plans.layout import DeviceGrid, RecipeLayout
from lightning_nnscaler.plans.propagate import Choose, Walk, place, propagate
from lightning_nnscaler.plans.shared_kv import merge_walks, shared_kv_heads, split_shared_heads

LINEAR = "aten.linear.default"
ADDMM = "aten.addmm.default"


def is_linear(op: Op) -> bool:
    """A linear layer: ``aten.linear``, or ``addmm(bias, x, weight)`` with a parameter weight (Hugging Face's
    ``Conv1D``: GPT-2's layers), whose dims carry the same names (``n`` out, ``k`` in)."""
    if op.target == LINEAR:
        return True
    return op.target == ADDMM and len(op.tensor_inputs) == 3 and op.tensor_inputs[2].tensor.role == "parameter"


@dataclass(frozen=True, kw_only=True)
class TensorParallelConfig:
    """The tp recipe's parameters."""

    degree: int | None = field(default=None, metadata={"minimum": 1})
    """Devices per tensor-parallel group; null means world_size. A smaller degree makes world_size / degree
    data-parallel replicas of the group (as hybrid does)."""


def tp(graph: Graph, ctx: PlanContext, config: TensorParallelConfig) -> None:
    """Megatron tensor parallelism over ``degree`` devices (default: all of them).

    A ``degree`` below ``world_size`` makes ``world_size // degree`` data-parallel replicas of the
    tensor-parallel group: the same plan as ``hybrid(dp=world_size // degree, tp=degree)``.
    """
    degree = ctx.world_size if config.degree is None else config.degree
    if not isinstance(degree, int) or degree < 1 or ctx.world_size % degree:
        raise ValueError(f"tp: degree ({degree!r}) must be a positive divisor of world_size ({ctx.world_size})")
    if degree < ctx.world_size:
        from lightning_nnscaler.plans.hybrid import HybridConfig, hybrid  # hybrid imports this module

        hybrid(graph, ctx, HybridConfig(dp=ctx.world_size // degree, tp=degree))
        return
    place(graph, tensor_parallel(graph, degree, share_kv_heads=True), range(degree))


def tensor_parallel(
    graph: Graph, parts: int, ops: Sequence[str] | None = None, choose: Choose | None = None, *, share_kv_heads: bool = False,
) -> Walk:
    """Split ``ops`` (default: all) the Megatron way into ``parts`` pieces; nothing is placed.

    With ``share_kv_heads`` (for one piece per rank, not co-shard's several: copies of one kv head would meet on
    a rank), grouped-query attention with fewer key/value heads than ``parts`` (a multiple of them) keeps each
    kv head on ``parts / kv`` ranks (``plans.shared_kv``); the walk's steps then hold those copies as pieces.
    """
    choose = choose or megatron_choice(graph)
    names = list(ops) if ops is not None else [op.name for op in graph.ops]
    shared = shared_kv_heads(graph, names, parts) if parts > 1 and share_kv_heads else []
    if not shared:
        return propagate(graph, parts, ops=names, choose=choose)
    on_paths = {name for heads in shared for name in heads.ops}
    walk = propagate(graph, parts, ops=[name for name in names if name not in on_paths], choose=choose)
    return merge_walks(names, walk, split_shared_heads(graph, shared, parts, choose))


def megatron_choice(graph: Graph) -> Choose:
    """The split rule: linears by rows when their input arrives split on ``k`` (final ones too),
    else by columns, except the final ones (left whole); other ops follow the split that reaches them."""
    final = final_linears(graph)

    def choose(op: Op, offered: list[str]) -> str | None:
        if is_linear(op):
            if "k" in offered:
                return "k"
            return None if op.source_name in final else "n"
        return offered[0] if offered else None

    return choose


def final_linears(graph: Graph) -> set[str]:
    """Source names of the linears that no other linear reads from, directly or through other ops."""
    feeds_linear: set[str] = set()  # tensors some linear reads, directly or through other ops
    final: set[str] = set()
    for op in reversed(graph.ops):
        downstream = any(output.name in feeds_linear for output in op.outputs)
        if is_linear(op) and not downstream:
            final.add(op.source_name)
        if downstream or is_linear(op):
            feeds_linear.update(piece.name for piece in op.tensor_inputs)
    return final


def tp_layout(world_size: int, params: dict[str, Any]) -> RecipeLayout:
    """``world_size // degree`` data-parallel replicas of ``degree`` consecutive ranks; heads cut in ``degree``."""
    degree = params["degree"] or world_size
    if degree < 1 or world_size % degree:
        raise ValueError(f"tp: degree ({degree!r}) must be a positive divisor of world_size ({world_size})")
    reason = f"degree={params['degree']}" if params["degree"] else f"degree=None: all {world_size} devices"
    return RecipeLayout(DeviceGrid.of(dp=world_size // degree, tp=degree), degree, reason)
