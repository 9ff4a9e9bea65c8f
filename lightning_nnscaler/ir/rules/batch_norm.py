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
"""

from __future__ import annotations

from lightning_nnscaler.ir.op import Op
from lightning_nnscaler.ir.rules.common import _text, argument
from lightning_nnscaler.ir.rules.registry import register_annotation

FUNCTIONAL_BATCH_NORM = "aten._native_batch_norm_legit_functional.default"
BATCH_NORM = "aten.batch_norm.default"
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


def per_piece_statistics(op: Op) -> bool:
    """Whether a cut of ``op``'s batch dim ``BATCH_DIM`` computes statistics per piece (not as one device would)."""
    return op.target == FUNCTIONAL_BATCH_NORM or (op.target == BATCH_NORM and bool(argument(op, 5, "training", False)))
