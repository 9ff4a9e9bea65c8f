"""BatchNorm in training mode: statistics per piece of the batch, as under ddp.

Capture writes a training-mode ``batch_norm`` that updates running statistics as
``_native_batch_norm_legit_functional`` (outputs: the normalized input, the batch mean and inverse
std, the new running mean and variance), so the updates are values of the graph.

Splitting the channel dim ``c`` is exact. Splitting the batch dim ``n`` is not: each piece
normalizes its rows with their own mean and variance and computes its own running statistics. That
is what ddp does (each replica normalizes with its own batch's statistics, ``torch.nn.BatchNorm*``
is not synchronized), so a data-parallel plan cuts ``n`` at the replicas and trains as ddp trains;
``verify`` checks such a plan against one device whose statistics ops are cut at the same rows
(``per_piece_statistics``). A cut finer than the replicas (microbatches of a pipeline) takes
statistics per microbatch, as ``torch.distributed.pipelining`` does; planning warns then.

``nn.SyncBatchNorm`` is captured as per-channel sums instead (``capture.sync_batch_norm``): statistics over
the global batch (``SYNC_MOMENTS``), and new running statistics (``SYNC_RUNNING_STATISTICS``), from the
global sums.
"""

from __future__ import annotations

import torch

from lightning_nnscaler.ir.op import Op
from lightning_nnscaler.ir.rules.common import _text, argument
from lightning_nnscaler.ir.rules.registry import register_annotation

FUNCTIONAL_BATCH_NORM = "aten._native_batch_norm_legit_functional.default"
BATCH_NORM = "aten.batch_norm.default"
SYNC_MOMENTS = "lnn.sync_batch_norm_moments.default"
"""``(sum, sum_of_squares, count, eps)`` -> the mean and the inverse standard deviation ``rsqrt(variance + eps)`` (C,)."""
SYNC_RUNNING_STATISTICS = "lnn.sync_batch_norm_running_statistics.default"
"""``(running_mean, running_var, sum, sum_of_squares, momentum, count)`` -> the new running mean and variance (C,)."""
BATCH_DIM = "n"
"""The annotation name of the batch dim of every op in ``per_piece_statistics``."""


def _spatial(count: int) -> list[str]:
    return [f"s{index}" for index in range(count)]


@register_annotation(FUNCTIONAL_BATCH_NORM)
def _functional_batch_norm(op: Op) -> str | None:
    x, *rest = op.tensor_inputs
    if len(x.shape) < 2:
        return None
    channel = ["c"]
    # inputs: x, weight?, bias?, running_mean, running_var; outputs: y, mean, rstd, new mean, new var.
    outputs = [[BATCH_DIM, "c", *_spatial(len(x.shape) - 2)]] + [channel] * (len(op.outputs) - 1)
    return _text([outputs[0]] + [channel] * len(rest), outputs)


@register_annotation(BATCH_NORM)
def _batch_norm(op: Op) -> str | None:
    x, *rest = op.tensor_inputs
    if len(x.shape) < 2:
        return None
    full = [BATCH_DIM, "c", *_spatial(len(x.shape) - 2)]  # in evaluation (running statistics) every cut is exact
    return _text([full] + [["c"]] * len(rest), [full])


# --- nn.SyncBatchNorm (``capture.sync_batch_norm``): statistics of the global batch from its per-channel sums ---
# Both ops read the sums whole (not linear in them), so a data-parallel plan all-reduces the sums, 2·C numbers.


def _moments(total: torch.Tensor, total_of_squares: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean and the biased variance (before clamping it at 0, which rounding can cross) of ``count`` values per channel."""
    mean = total / count
    return mean, total_of_squares / count - mean * mean


@torch.library.custom_op(SYNC_MOMENTS.removesuffix(".default").replace(".", "::"), mutates_args=())
def sync_moments(total: torch.Tensor, total_of_squares: torch.Tensor, count: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean and ``rsqrt(variance + eps)`` per channel, from the sums over ``count`` values per channel."""
    mean, variance = _moments(total, total_of_squares, count)
    return mean, torch.rsqrt(variance.clamp_min(0) + eps)


@sync_moments.register_fake
def _sync_moments_shape(total: torch.Tensor, total_of_squares: torch.Tensor, count: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(total), torch.empty_like(total)


def _save_moments(ctx, inputs: tuple, output: tuple[torch.Tensor, torch.Tensor]) -> None:
    total, total_of_squares, count, eps = inputs
    ctx.save_for_backward(total, total_of_squares, output[1])
    ctx.count = count


def _moments_backward(ctx, mean_gradient: torch.Tensor, invstd_gradient: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
    total, total_of_squares, invstd = ctx.saved_tensors
    mean, variance = _moments(total, total_of_squares, ctx.count)
    # d rsqrt(v + eps) / dv = -invstd³ / 2; clamp_min passes the gradient where the unclamped variance is >= 0
    variance_gradient = torch.where(variance >= 0, invstd_gradient * invstd.pow(3) * -0.5, torch.zeros_like(invstd))
    return (mean_gradient - 2 * mean * variance_gradient) / ctx.count, variance_gradient / ctx.count, None, None


sync_moments.register_autograd(_moments_backward, setup_context=_save_moments)


@torch.library.custom_op(SYNC_RUNNING_STATISTICS.removesuffix(".default").replace(".", "::"), mutates_args=())
def sync_running_statistics(
    running_mean: torch.Tensor, running_var: torch.Tensor, total: torch.Tensor, total_of_squares: torch.Tensor, momentum: float, count: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``SyncBatchNorm``'s update (``batch_norm_gather_stats_with_counts``): the variance unbiased with the global ``count``."""
    mean, variance = _moments(total, total_of_squares, count)
    unbiased = variance.clamp_min(0) * (count / (count - 1))
    return running_mean * (1 - momentum) + mean * momentum, running_var * (1 - momentum) + unbiased * momentum


@sync_running_statistics.register_fake
def _sync_running_statistics_shape(running_mean: torch.Tensor, running_var: torch.Tensor, *_: object) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(running_mean), torch.empty_like(running_var)


@register_annotation(SYNC_MOMENTS, SYNC_RUNNING_STATISTICS)
def _sync_statistics(op: Op) -> str:
    return _text([["c"]] * len(op.tensor_inputs), [["c"]] * len(op.outputs))


def per_piece_statistics(op: Op) -> bool:
    """Whether a cut of ``op``'s batch dim ``BATCH_DIM`` computes statistics per piece (not as one device would)."""
    return op.target == FUNCTIONAL_BATCH_NORM or (op.target == BATCH_NORM and bool(argument(op, 5, "training", False)))
