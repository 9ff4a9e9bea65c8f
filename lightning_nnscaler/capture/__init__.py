"""Capture: model + example inputs -> annotated IR Graph."""

from lightning_nnscaler.capture import annotations, annotations_nn, annotations_shape  # noqa: F401 - register rules
from lightning_nnscaler.capture.convert import CaptureError
from lightning_nnscaler.capture.registry import register_annotation
from lightning_nnscaler.capture.trace import bind_inputs, flatten_inputs, trace

__all__ = ["CaptureError", "bind_inputs", "flatten_inputs", "register_annotation", "trace"]
