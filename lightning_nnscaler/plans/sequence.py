"""Megatron sequence parallelism (Korthikanti et al. 2022): tensor parallelism, plus the ops it would
replicate between the linears (LayerNorm, dropout, residual adds) split along the sequence instead."""

from __future__ import annotations

from typing import Any

from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir.op import Op
from lightning_nnscaler.plans.context import PlanContext
from lightning_nnscaler.plans.layout import DeviceGrid, RecipeLayout
from lightning_nnscaler.plans.megatron_tp import LINEAR, megatron_choice, tensor_parallel
from lightning_nnscaler.plans.propagate import place


def sp(graph: Graph, ctx: PlanContext) -> None:
    """`tp` over all devices; every other op with an output ``(B, T, ...)`` is split along T.

    T is recognised by shape: dim 1 of a user input (token ids ``(B, T)``). The sequence split then
    flows on through non-linear ops; at a column-split linear the materialization all-gathers the
    input, and where a row-split linear's partial sums meet a sequence-split op, reduce-scatters.
    Final linears (LM head) stay whole, as in `tp`.
    """
    lengths = {tensor.shape[1] for tensor in graph.user_inputs if tensor.rank >= 2}
    megatron = megatron_choice(graph)

    def choose(op: Op, offered: list[str]) -> str | None:
        if op.target == LINEAR:
            return megatron(op, offered)
        return offered[0] if offered else sequence_name(op, lengths)

    place(graph, tensor_parallel(graph, ctx.world_size, choose=choose, share_kv_heads=True), range(ctx.world_size))


def sequence_name(op: Op, lengths: set[int]) -> str | None:
    """The annotation name of dim 1 of the op's first output shaped ``(B, T, ...)``, T in ``lengths``."""
    annotation = op.dims
    if annotation is None:
        return None
    for output, spec in zip(op.outputs, annotation.outputs):
        if len(output.shape) >= 3 and output.shape[1] in lengths and spec[1].names:
            return spec[1].names[0]
    return None


def sp_layout(world_size: int, params: dict[str, Any]) -> RecipeLayout:
    """One replica over every rank; heads cut in ``world_size`` pieces."""
    return RecipeLayout(DeviceGrid.of(tp=world_size), world_size, f"all {world_size} devices")
