"""Capture: model + example inputs -> annotated IR Graph."""

from lightning_nnscaler.capture.convert import CaptureError
from lightning_nnscaler.capture.step_values import FrozenValueError, StepValues
from lightning_nnscaler.capture.trace import bind_inputs, flatten_inputs, trace, trace_training_step
from lightning_nnscaler.ir.rules import register_annotation

__all__ = [
    "CaptureError", "FrozenValueError", "StepValues", "bind_inputs", "flatten_inputs", "register_annotation", "trace", "trace_training_step",
]
