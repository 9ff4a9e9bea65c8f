"""Keep torchvision importable next to a torchvision wheel built for another torch (CUDA kernels, CPU torch).

PyPI's torchvision wheel for torch 2.13 links CUDA libraries, so next to the CPU torch wheel its ``_C``
kernels cannot load, and its import then fails while registering fake kernels for
``torchvision::nms``/``qnms`` (``operator torchvision::nms does not exist``). Lightning (through
torchmetrics), timm and transformers import torchvision, so every one of them would fail to import.
When the kernels cannot load, declaring those two op schemas lets the pure-Python part of
torchvision import; its detection kernels (NMS) stay unavailable.

This module is a ``torch.backends`` entry point of the lightning-nnscaler distribution: torch calls
``declare_torchvision_ops_when_its_kernels_cannot_load`` at the end of its own import (its plug-in
mechanism for out-of-tree backends), before anything can import torchvision, whatever a script
imports first. It is a top-level module so that it imports nothing of ``lightning_nnscaler``; where
torchvision's kernels match torch (or torchvision is absent) it only reads torchvision's version file.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

_declared: list[Any] = []  # the torch.library.Library that holds the two schemas, once declared


def _torchvision_folder() -> Path | None:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def _built_for_cuda(torchvision: Path) -> bool:
    """Whether the installed torchvision says it is a CUDA build (``0.28.0+cu130``), read without importing it."""
    try:
        version_file = (torchvision / "version.py").read_text()
    except OSError:
        return False
    return "+cu" in version_file.split("\n", 1)[0]


def declare_torchvision_ops_when_its_kernels_cannot_load() -> None:
    """Declare ``torchvision::nms``/``qnms`` if torchvision is installed but its kernels cannot load."""
    if _declared:
        return
    import torch

    torchvision = _torchvision_folder()
    if torchvision is None or torch.version.cuda is not None or not _built_for_cuda(torchvision):
        return
    kernels = next(torchvision.glob("_C*.so"), None)
    if kernels is None:
        return
    try:
        torch.ops.load_library(str(kernels))
        return
    except OSError:
        pass
    library = torch.library.Library("torchvision", "DEF")
    library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _declared.append(library)
