"""A vocabulary slice of an embedding table: the op a piece of ``aten.embedding`` becomes when its table
is split by rows (vocabulary-parallel embedding, Megatron's ``VocabParallelEmbedding``).

The piece holding rows ``[start, start + rows)`` looks up the token ids that fall in its slice and
writes zeros for the others, so the pieces of all slices are value parts that add up to the whole
lookup exactly (one part is the row, the others exact zeros). Its backward adds each gradient row
into the table row its token id selects, for the ids in the slice only.
"""

from __future__ import annotations

import torch

VOCAB_EMBEDDING_OP = "lnn.vocab_embedding.default"
"""The IR target: ``(table rows [start, start + rows), token ids, start)`` -> ``(*ids.shape, dim)``."""


def _local_ids(ids: torch.Tensor, start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    local = ids - start
    inside = (local >= 0) & (local < rows)
    return torch.where(inside, local, torch.zeros_like(local)), inside


@torch.library.custom_op(VOCAB_EMBEDDING_OP.removesuffix(".default").replace(".", "::"), mutates_args=())
def vocab_embedding(table: torch.Tensor, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Rows of ``table`` (vocabulary rows ``start`` on) for the ids in its slice; zeros for the others."""
    local, inside = _local_ids(ids, start, table.shape[0])
    return torch.nn.functional.embedding(local, table) * inside.unsqueeze(-1).to(table.dtype)


@vocab_embedding.register_fake
def _vocab_embedding_shape(table: torch.Tensor, ids: torch.Tensor, start: int) -> torch.Tensor:
    return table.new_empty((*ids.shape, table.shape[1]))


def _save(ctx, inputs: tuple, output: torch.Tensor) -> None:
    table, ids, start = inputs
    ctx.save_for_backward(ids)
    ctx.start, ctx.rows, ctx.width = start, table.shape[0], table.shape[1]


def _backward(ctx, gradient: torch.Tensor) -> tuple[torch.Tensor, None, None]:
    (ids,) = ctx.saved_tensors
    local, inside = _local_ids(ids, ctx.start, ctx.rows)
    table_gradient = torch.zeros((ctx.rows, ctx.width), dtype=gradient.dtype, device=gradient.device)
    rows = gradient.reshape(-1, ctx.width)[inside.reshape(-1)]
    table_gradient.index_add_(0, local.reshape(-1)[inside.reshape(-1)], rows)
    return table_gradient, None, None


vocab_embedding.register_autograd(_backward, setup_context=_save)
