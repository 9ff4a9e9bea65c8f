"""``nn.SyncBatchNorm`` in training mode: statistics over every data-parallel replica, from per-channel sums.

Under ddp, ``SyncBatchNorm`` all-reduces each rank's per-channel statistics, so every rank normalizes
with the mean and variance of the global batch: one device's ``BatchNorm`` over the global batch. The
plan runs the step over the global batch, so capture writes that computation as ops the plan splits
by value, never by gathering activations::

    sum = x.sum(dims)        sum_of_squares = (x * x).sum(dims)      # dims: n and the spatial dims; (C,)
    mean, invstd = SYNC_MOMENTS(sum, sum_of_squares, count, eps)     # / count, rsqrt(sum_of_squares / count - mean² + eps)
    y = (x - mean) * (invstd * weight) + bias                         # elementwise: split by n as x is

Splitting ``n`` leaves both sums value-partial; ``SYNC_MOMENTS`` reads them whole (it is not linear in
them), so a data-parallel plan all-reduces 2·C numbers per layer forward, and their gradients, 2·C,
backward (as ``SyncBatchNorm``'s backward all-reduces two per-channel sums). ``count`` is the global
batch's, so the new running statistics (the unbiased variance with the global count, as
``SyncBatchNorm``) come from the global sums in ``SYNC_RUNNING_STATISTICS``: an op of the plan, not
recomputed per replica (``replica_buffers`` leaves ``batch_norm`` ops to the plan).

Tracing runs ``SyncBatchNorm`` as ``BatchNorm`` (``sync_batch_norm_traced``: under an initialized process
group it would refuse CPU tensors, or trace its collectives); the converter knows its ``batch_norm`` by
the module it was called from (``from_sync_batch_norm``).
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_nnscaler.ir.rules.batch_norm import SYNC_MOMENTS, SYNC_RUNNING_STATISTICS
from lightning_nnscaler.ir.tensor import VTensor

if TYPE_CHECKING:
    from lightning_nnscaler.capture.convert import _Converter

_SYNC_BATCH_NORM = f"{nn.SyncBatchNorm.__module__}.{nn.SyncBatchNorm.__qualname__}"


def _traced_forward(self: nn.SyncBatchNorm, input: torch.Tensor) -> torch.Tensor:
    if self.process_group is not None and dist.is_initialized() and self.process_group != dist.group.WORLD:
        from lightning_nnscaler.capture.convert import CaptureError

        raise CaptureError(
            "an nn.SyncBatchNorm has a process_group other than the world: the plan synchronizes statistics over every "
            "data-parallel replica; convert with nn.SyncBatchNorm.convert_sync_batchnorm(model) (process_group=None)"
        )
    return _BatchNorm.forward(self, input)


@contextlib.contextmanager
def sync_batch_norm_traced() -> Iterator[None]:
    """``nn.SyncBatchNorm`` runs as ``BatchNorm`` (its functional ``batch_norm``) while a step is traced."""
    original = nn.SyncBatchNorm.forward
    nn.SyncBatchNorm.forward = _traced_forward  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.SyncBatchNorm.forward = original  # type: ignore[method-assign]


def from_sync_batch_norm(node: fx.Node) -> bool:
    """Whether ``node`` was called by an ``nn.SyncBatchNorm`` (the innermost module of its call)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return False
    kind = list(stack.values())[-1][1]  # the module's class, or its qualified name (as non-strict export records it)
    return (kind if isinstance(kind, str) else f"{kind.__module__}.{kind.__qualname__}") == _SYNC_BATCH_NORM


def decompose_sync_batch_norm(converter: _Converter, node: fx.Node, bound: dict[str, Any], statistics: list[Any], no_grad: bool) -> bool:
    """A training-mode ``batch_norm`` of an ``nn.SyncBatchNorm`` as statistics from per-channel sums (see above)."""
    x: VTensor = bound["input"]
    if len(x.shape) < 2:
        return False
    value, name = node.meta["val"], node.name
    channels, rank = x.shape[1], len(x.shape)
    dims = [0, *range(2, rank)]
    count = math.prod(x.shape[dim] for dim in dims)  # the global batch's
    vector = value.new_empty((channels,))
    broadcast = [channels] + [1] * (rank - 2)  # (C, 1, ...) against (N, C, ...)

    def emit(suffix: str, target: str, args: list[Any], meta: Any = vector) -> VTensor:
        return converter.emit(f"{name}_{suffix}", target, args, {}, meta, no_grad)

    total = emit("sum", "aten.sum.dim_IntList", [x, dims])
    total_of_squares = emit("sum_of_squares", "aten.sum.dim_IntList", [emit("squares", "aten.mul.Tensor", [x, x], value), dims])
    mean, scale = converter.emit(f"{name}_moments", SYNC_MOMENTS, [total, total_of_squares, count, float(bound["eps"])], {}, (vector, vector), no_grad)
    if bound.get("weight") is not None:
        scale = emit("scale", "aten.mul.Tensor", [scale, bound["weight"]])
    centered = emit("centered", "aten.sub.Tensor", [x, emit("mean_view", "aten.view.default", [mean, broadcast], value.new_empty(broadcast))], value)
    output = emit("scaled", "aten.mul.Tensor", [centered, emit("scale_view", "aten.view.default", [scale, broadcast], value.new_empty(broadcast))], value)
    if bound.get("bias") is not None:
        output = emit("shifted", "aten.add.Tensor", [output, emit("bias_view", "aten.view.default", [bound["bias"], broadcast], value.new_empty(broadcast))], value)
    converter.values[node] = output
    if all(isinstance(item, fx.Node) for item in statistics):
        running = [bound["running_mean"], bound["running_var"], total, total_of_squares, float(bound["momentum"]), count]
        new_values = converter.emit(f"{name}_running", SYNC_RUNNING_STATISTICS, running, {}, (vector, vector), no_grad=True)
        for statistic, new_value in zip(statistics, new_values):
            converter.write_back(node, statistic, new_value, no_grad=True)
    return True
