"""torchmetrics ``Metric``s a traced ``training_step`` updates: recorded, and updated after the step.

A ``Metric`` keeps Python state and runs data-dependent code (input checks, ``bincount``), which the
captured step cannot hold. While the step is traced, each ``Metric`` of the module tree has its
``forward`` (``self.train_acc(preds, target)``), ``update``, ``compute`` and ``reset`` replaced by a
recorder: the call
becomes a `MetricCall` whose tensor arguments are extra outputs of the traced step, and it returns a
`MetricResult` that ``self.log`` may take (any other use is refused). After every step the strategy
makes the same call on the real ``Metric``, eagerly, with this rank's data-parallel replica's values
of those tensors (``logged_values``), so the metric's state, ``compute()`` and
``self.log(name, metric)`` behave as under ddp.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_nnscaler.capture.convert import CaptureError
from lightning_nnscaler.capture.step_values import user_location


def is_metric(module: nn.Module) -> bool:
    """Whether ``module`` is a torchmetrics ``Metric`` (by its MRO, without importing torchmetrics)."""
    return any(klass.__module__.startswith("torchmetrics") and klass.__name__ == "Metric" for klass in type(module).__mro__)


@dataclass(frozen=True)
class MetricCall:
    """``<path>.<method>(*arguments)`` made by the traced step: each argument ``("output", position)`` (a
    tensor the step computes, by its position among the step's outputs) or ``("constant", value)``."""

    path: str
    method: str
    arguments: tuple[tuple[str, Any], ...]
    keywords: tuple[tuple[str, tuple[str, Any]], ...]
    location: str


class MetricResult:
    """What a recorded ``metric(...)`` returns while tracing: only ``self.log`` may take it."""

    __slots__ = ("call",)

    def __init__(self, call: int) -> None:
        self.call = call

    def __getattr__(self, name: str) -> Any:
        _refuse()


def _refuse(*_: Any) -> Any:
    raise CaptureError(
        "training_step uses the value a torchmetrics Metric's call returned (other than logging it): the metric is "
        "updated after the step, outside the captured computation. Log it (self.log(name, value)) or the metric "
        "object itself (self.log(name, metric)), and compute with tensors instead."
    )


for _name in """add radd sub rsub mul rmul truediv rtruediv pow rpow neg bool float int index lt le gt ge eq ne""".split():
    setattr(MetricResult, f"__{_name}__", _refuse)


class MetricRecorder:
    """Records the traced step's metric calls; tensor arguments go to ``output_of`` (the step's extra outputs)."""

    def __init__(self, module: nn.Module, output_of: Any) -> None:
        self.paths = {id(sub): path for path, sub in module.named_modules() if is_metric(sub)}
        self.modules = {path: sub for path, sub in module.named_modules() if is_metric(sub)}
        self.output_of = output_of
        self.calls: list[MetricCall] = []

    def path_of(self, metric: nn.Module) -> str | None:
        return self.paths.get(id(metric))

    def record(self, path: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> MetricResult:
        self.calls.append(MetricCall(
            path, method, tuple(self._argument(value) for value in args),
            tuple((key, self._argument(value)) for key, value in kwargs.items()), user_location(),
        ))
        return MetricResult(len(self.calls) - 1)

    def _argument(self, value: Any) -> tuple[str, Any]:
        if isinstance(value, torch.Tensor):  # a copy: an output that an op computes, even of a batch input
            return ("output", self.output_of(value.detach().clone()))
        if isinstance(value, (bool, int, float, str, type(None))):
            return ("constant", value)
        raise CaptureError(f"training_step passes a {type(value).__name__} to a torchmetrics Metric; pass tensors or numbers")

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Inside: every Metric's ``forward``, ``update``, ``compute`` and ``reset`` record their call instead of running."""
        replaced = []
        for path, metric in self.modules.items():
            for method in ("forward", "update", "compute", "reset"):
                replaced.append((metric, method, metric.__dict__.get(method)))
                setattr(metric, method, lambda *args, path=path, method=method, **kwargs: self.record(path, method, args, kwargs))
        try:
            yield
        finally:
            for metric, method, own in replaced:
                if own is None:
                    del metric.__dict__[method]
                else:
                    metric.__dict__[method] = own
