"""Pooling: each window lies inside one image and one channel, so the batch and channel dims split
exactly; the pooled (spatial) dims stay whole (a window may cross any cut of them)."""

from __future__ import annotations

from lightning_nnscaler.ir.op import Op
from lightning_nnscaler.ir.rules.common import _text
from lightning_nnscaler.ir.rules.registry import register_annotation

_SPATIAL_DIMS = {
    **dict.fromkeys(["aten.max_pool1d.default", "aten.avg_pool1d.default", "aten.adaptive_avg_pool1d.default"], 1),
    **dict.fromkeys(["aten.max_pool2d.default", "aten.avg_pool2d.default", "aten.adaptive_avg_pool2d.default"], 2),
    **dict.fromkeys(["aten.max_pool3d.default", "aten.avg_pool3d.default", "aten.adaptive_avg_pool3d.default"], 3),
}


@register_annotation(*_SPATIAL_DIMS)
def _pooling(op: Op) -> str | None:
    x = op.tensor_inputs[0]
    spatial = _SPATIAL_DIMS[op.target]
    leading = len(x.shape) - spatial
    if leading < 1 or len(op.outputs) != 1:
        return None
    names = ["n", "c"][-leading:] if leading <= 2 else None
    if names is None:
        return None
    return _text([names + [f"i{index}^" for index in range(spatial)]], [names + [f"o{index}^" for index in range(spatial)]])
