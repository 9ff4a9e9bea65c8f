"""A fit's predicted and measured step time (``plan_logging`` logs both).

**Predicted**: ``sim.predict`` on the plan the first batch made, on the shipped spec that matches the
device (``sim.specs.spec_for_device``: the measured ``cpu`` spec on CPU, ``h100`` on an H100, ...;
another GPU gets ``a100`` and a note saying so). It reuses the built plan, so it costs what one
simulation does (tens of milliseconds on the reference GPT plans, against about a second of planning).
A simulator failure never stops training: no prediction, and one warning with the reason.

**Measured**: the wall time of each optimizer step — Lightning's closure (the generated forward,
backward and gradient reduction) and the optimizer update, the step the simulator models — after the
first ``MEASURED_AFTER`` (planning, allocator and cache warm-up); on CUDA between events recorded on
the device's stream, read once they have completed, so timing adds no synchronization.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

MEASURED_AFTER = 3
"""Optimizer steps left out of the measured median: the first plans, the next warm up caches and allocators."""


@dataclass(frozen=True)
class PredictedStep:
    """The simulated step of a fit's plan: on which spec, and how long."""

    spec: str
    """The shipped spec's name (``load_spec`` takes it)."""
    spec_name: str
    """The device the spec describes (its ``name``)."""
    step_seconds: float
    note: str
    """Why this spec, when it is not the device's own ("" when it is)."""


def device_name(device: torch.device) -> str:
    """``"cpu"``, or the CUDA device's name (``"NVIDIA H100 80GB HBM3"``)."""
    return "cpu" if device.type != "cuda" else torch.cuda.get_device_name(device)


def predict_step(plan: Any, device: torch.device) -> PredictedStep | None:
    """``plan``'s simulated step on the spec matching ``device``; None, with a warning naming the
    reason, when the simulator fails (training goes on)."""
    try:
        from lightning_nnscaler.sim import predict, spec_for_device  # the simulator only when a fit plans

        spec, note = spec_for_device(device_name(device))
        prediction = predict(plan, spec)
    except Exception as error:  # any simulator bug: the run must not depend on its prediction
        rank_zero_warn(f"NnScalerStrategy: no predicted step time is logged, the simulator failed: {type(error).__name__}: {error}")
        return None
    return PredictedStep(spec, prediction.spec_name, prediction.step_seconds, note)


class StepTimer:
    """Wall time of each optimizer step after the first ``MEASURED_AFTER`` (``start`` and ``stop`` around it)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.steps = 0
        self.seconds: list[float] = []
        self._started: Any = None
        self._pending: deque[tuple[Any, Any]] = deque()  # CUDA (start, end) events not yet read

    def start(self) -> None:
        """An optimizer step begins."""
        self.steps += 1
        self._started = None if self.steps <= MEASURED_AFTER else self._now()

    def stop(self) -> None:
        """The optimizer step ended."""
        if self._started is None:
            return
        if self.device.type == "cuda":
            self._pending.append((self._started, self._now()))
            while self._pending and self._pending[0][1].query():
                self._read_oldest()
        else:
            self.seconds.append(time.perf_counter() - self._started)
        self._started = None

    def median_seconds(self) -> float | None:
        """The median measured step (None before any step after ``MEASURED_AFTER``)."""
        while self._pending:
            self._pending[0][1].synchronize()
            self._read_oldest()
        return statistics.median(self.seconds) if self.seconds else None

    def _now(self) -> Any:
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _read_oldest(self) -> None:
        start, end = self._pending.popleft()
        self.seconds.append(start.elapsed_time(end) / 1e3)  # elapsed_time is in milliseconds
