"""Keep Lightning importable next to a torchvision wheel whose kernels do not match the torch build.

PyPI's torchvision wheel for torch 2.13 links CUDA libraries, so on a CPU-only torch its ``_C``
kernels cannot load, and its import then fails while registering fake kernels for
``torchvision::nms``/``qnms``. Lightning (through torchmetrics), timm and transformers all import
torchvision, so that failure would break them. When the kernels cannot load, declaring those two
schemas lets the pure-Python part of torchvision import; the detection kernels stay unavailable.

The check needs torch, so it does not run at ``import lightning_nnscaler`` (which imports no torch):
the package runs it just before torchvision is first looked for (``_import_hooks.call_before_import``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

_declared: list[Any] = []  # the torch.library.Library that holds the two schemas, once declared


def declare_torchvision_ops_when_its_kernels_cannot_load() -> None:
    """Declare ``torchvision::nms``/``qnms`` if torchvision is installed but its kernels cannot load."""
    if _declared:
        return
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return
    kernels = next(Path(spec.origin).parent.glob("_C*.so"), None)
    if kernels is None:
        return
    import torch  # only here: importing lightning_nnscaler must not cost torch's import

    try:
        torch.ops.load_library(str(kernels))
        return
    except OSError:
        pass
    library = torch.library.Library("torchvision", "DEF")
    library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _declared.append(library)
