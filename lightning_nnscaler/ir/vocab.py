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
"""The IR target: ``(table rows [start, start + rows), token ids, start, padding_idx)`` -> ``(*ids.shape, dim)``;
``padding_idx`` (a vocabulary id, -1 for none) gets no gradient, as in ``nn.Embedding``."""


def _local_ids(ids: torch.Tensor, start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    local = ids - start
    inside = (local >= 0) & (local < rows)
    return torch.where(inside, local, torch.zeros_like(local)), inside


@torch.library.custom_op(VOCAB_EMBEDDING_OP.removesuffix(".default").replace(".", "::"), mutates_args=())
def vocab_embedding(table: torch.Tensor, ids: torch.Tensor, start: int, padding_idx: int = -1) -> torch.Tensor:
    """Rows of ``table`` (vocabulary rows ``start`` on) for the ids in its slice; zeros for the others."""
    local, inside = _local_ids(ids, start, table.shape[0])
    return torch.nn.functional.embedding(local, table) * inside.unsqueeze(-1).to(table.dtype)


@vocab_embedding.register_fake
def _vocab_embedding_shape(table: torch.Tensor, ids: torch.Tensor, start: int, padding_idx: int = -1) -> torch.Tensor:
    return table.new_empty((*ids.shape, table.shape[1]))


def _save(ctx, inputs: tuple, output: torch.Tensor) -> None:
    table, ids, start, padding_idx = inputs
    ctx.save_for_backward(ids)
    ctx.start, ctx.rows, ctx.width, ctx.padding_idx = start, table.shape[0], table.shape[1], padding_idx


def _backward(ctx, gradient: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
    (ids,) = ctx.saved_tensors
    local, inside = _local_ids(ids, ctx.start, ctx.rows)
    if ctx.padding_idx >= 0:
        inside = inside & (ids != ctx.padding_idx)
    table_gradient = torch.zeros((ctx.rows, ctx.width), dtype=gradient.dtype, device=gradient.device)
    # The rows of ids outside the slice add exact zeros (into row 0), rather than being selected out: no shape
    # depends on the ids' values, so torch.compile traces this backward whole.
    rows = torch.where(inside.reshape(-1, 1), gradient.reshape(-1, ctx.width), 0)
    table_gradient.index_add_(0, local.reshape(-1), rows)
    return table_gradient, None, None, None


vocab_embedding.register_autograd(_backward, setup_context=_save)


# --- cross-entropy over a vocabulary split by columns ------------------------------------------------
#
# cross_entropy(x, t) summed over rows is sum_rows(logsumexp(x) - x[t]). Over a vocabulary split by
# columns, both terms are sums over the columns, so each slice contributes value parts:
#   parts[:, 0] = sum over the slice's columns of exp(x - shift),  parts[:, 1] = x[t] if t is in the slice else 0,
# with a shift every slice knows: the row mean (the row sum, itself a sum of the slices' sums, over
# the vocabulary). Then loss = sum over kept rows of log(parts[:, 0]) + shift - parts[:, 1]. The
# shift cancels in the loss, so no gradient flows through it. (A row whose largest logit exceeds its
# mean by more than ~88 overflows float32 to inf: a loud failure, never a quiet one.)

VOCAB_LOSS_PARTS_OP = "lnn.vocab_loss_parts.default"
"""``(logits columns [start, start + c) (N, c), row sums (N,), targets (N,), start, vocabulary)`` -> ``(N, 2)`` value parts."""
LOSS_FROM_PARTS_OP = "lnn.loss_from_parts.default"
"""``(parts (N, 2), row sums (N,), targets (N,), vocabulary, ignore_index)`` -> the summed cross-entropy ``()``."""
VOCAB_TARGETS = (VOCAB_EMBEDDING_OP, VOCAB_LOSS_PARTS_OP, LOSS_FROM_PARTS_OP)
"""The ops of this module: generated code that calls one imports it."""


@torch.library.custom_op(VOCAB_LOSS_PARTS_OP.removesuffix(".default").replace(".", "::"), mutates_args=())
def vocab_loss_parts(logits: torch.Tensor, row_sums: torch.Tensor, targets: torch.Tensor, start: int, vocabulary: int) -> torch.Tensor:
    """This slice's value parts of ``(sum exp(x - mean), x[target])`` per row."""
    shifted = torch.exp(logits - (row_sums / vocabulary).unsqueeze(-1))
    local, inside = _local_ids(targets, start, logits.shape[-1])
    picked = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1) * inside.to(logits.dtype)
    return torch.stack([shifted.sum(-1), picked], dim=-1)


@vocab_loss_parts.register_fake
def _vocab_loss_parts_shape(logits: torch.Tensor, row_sums: torch.Tensor, targets: torch.Tensor, start: int, vocabulary: int) -> torch.Tensor:
    return logits.new_empty((logits.shape[0], 2))


def _save_parts(ctx, inputs: tuple, output: torch.Tensor) -> None:
    logits, row_sums, targets, start, vocabulary = inputs
    ctx.save_for_backward(logits, row_sums, targets)
    ctx.start, ctx.vocabulary = start, vocabulary


def _parts_backward(ctx, gradient: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
    logits, row_sums, targets = ctx.saved_tensors
    shifted = torch.exp(logits - (row_sums / ctx.vocabulary).unsqueeze(-1))
    logits_gradient = shifted * gradient[:, 0:1]
    local, inside = _local_ids(targets, ctx.start, logits.shape[-1])
    logits_gradient.scatter_add_(-1, local.unsqueeze(-1), (gradient[:, 1] * inside.to(gradient.dtype)).unsqueeze(-1))
    return logits_gradient, None, None, None, None


vocab_loss_parts.register_autograd(_parts_backward, setup_context=_save_parts)


@torch.library.custom_op(LOSS_FROM_PARTS_OP.removesuffix(".default").replace(".", "::"), mutates_args=())
def loss_from_parts(parts: torch.Tensor, row_sums: torch.Tensor, targets: torch.Tensor, vocabulary: int, ignore_index: int) -> torch.Tensor:
    """The summed cross-entropy of the rows whose target is not ``ignore_index``, from the added-up parts."""
    kept = (targets != ignore_index).to(parts.dtype)
    return ((torch.log(parts[:, 0]) + row_sums / vocabulary - parts[:, 1]) * kept).sum()


@loss_from_parts.register_fake
def _loss_from_parts_shape(parts: torch.Tensor, row_sums: torch.Tensor, targets: torch.Tensor, vocabulary: int, ignore_index: int) -> torch.Tensor:
    return parts.new_empty(())


def _save_loss(ctx, inputs: tuple, output: torch.Tensor) -> None:
    parts, _, targets, _, ignore_index = inputs
    ctx.save_for_backward(parts, targets)
    ctx.ignore_index = ignore_index


def _loss_backward(ctx, gradient: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
    parts, targets = ctx.saved_tensors
    kept = (targets != ctx.ignore_index).to(parts.dtype)
    parts_gradient = torch.stack([kept / parts[:, 0], -kept], dim=-1) * gradient
    return parts_gradient, None, None, None, None


loss_from_parts.register_autograd(_loss_backward, setup_context=_save_loss)
