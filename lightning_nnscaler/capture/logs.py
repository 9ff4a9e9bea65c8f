"""What a traced ``training_step`` logs: each ``self.log`` / ``self.log_dict`` call, recorded while tracing.

A captured step runs its Python once, at the trace; so a logged value must be computed by the
captured graph on every step. While ``training_step`` is traced, ``log`` and ``log_dict`` are
replaced by a `LogRecorder`: each call becomes a `LogCall` that keeps the name and Lightning's options
(``on_step``, ``on_epoch``, ``sync_dist``, ``prog_bar``, ``reduce_fx``, ``batch_size``, ...), and
each logged tensor becomes an extra output of the traced step (after the loss), so the graph computes
it. Plain numbers are logged as they are; ``tensor.item()`` is logged as its tensor (``capture.items``). What the graph cannot compute every step is refused at
tracing, naming the key: a tensor of more than one element, or an object such as a torchmetrics
``Metric``. A per-step value (``self.global_step``) is lifted into the graph (``capture.step_symbols``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from lightning_nnscaler.capture.convert import CaptureError
from lightning_nnscaler.capture.items import ItemValue
from lightning_nnscaler.capture.metrics import MetricRecorder, MetricResult
from lightning_nnscaler.capture.step_symbols import StepInt


@dataclass(frozen=True)
class LogCall:
    """One logged value of the traced step: its name, where its value comes from, Lightning's options."""

    name: str
    output: int | None
    """Position of the logged tensor among the step's outputs (0: the loss), or None for a constant."""
    constant: bool | int | float | None
    """The logged number when ``output`` is None."""
    options: dict[str, Any] = field(default_factory=dict)
    """The keyword arguments of ``LightningModule.log`` the call passed (``sync_dist``, ``on_epoch``, ...)."""
    metric: str | None = None
    """The path of a torchmetrics ``Metric`` logged as the object (``self.log(name, self.train_acc)``)."""
    metric_call: int | None = None
    """The index of the `MetricCall` whose returned value is logged (``self.log(name, self.train_acc(p, t))``)."""


class LogRecorder:
    """Stands in for ``module.log`` / ``module.log_dict`` while the step is traced."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module_name = type(module).__name__
        self.log_signature = _signature(module, "log")
        self.log_dict_signature = _signature(module, "log_dict")
        self.calls: list[LogCall] = []
        self.tensors: list[torch.Tensor] = []
        """Logged tensors, each once (by identity), in the order first logged; output ``i + 1`` is ``tensors[i]``."""
        self.loss: torch.Tensor | None = None
        self.metrics = MetricRecorder(module, self._output_of)
        self.returned = "loss"
        """What the traced step returned as output 0 (``TracedStep.returned``)."""

    def reset(self) -> None:
        """Forget the calls of an earlier trace of the step."""
        self.calls, self.tensors, self.metrics.calls = [], [], []

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        """Record ``self.log(name, value, ...)``."""
        options = _options(self.log_signature, (name, value, *args), kwargs, ("name", "value"))
        self._record(name, value, options)

    def log_dict(self, dictionary: Any, *args: Any, **kwargs: Any) -> None:
        """Record ``self.log_dict({name: value, ...}, ...)`` as one call per entry, with the same options."""
        options = _options(self.log_dict_signature, (dictionary, *args), kwargs, ("dictionary",))
        for name, value in dict(dictionary).items():
            self._record(str(name), value, options)

    def _record(self, name: str, value: Any, options: dict[str, Any]) -> None:
        if isinstance(value, MetricResult):
            self.calls.append(LogCall(name, None, None, options, metric_call=value.call))
            return
        if isinstance(value, torch.nn.Module) and self.metrics.path_of(value) is not None:
            self.calls.append(LogCall(name, None, None, options, metric=self.metrics.path_of(value)))
            return
        if isinstance(value, ItemValue):  # self.log(name, tensor.item()): the graph computes the tensor every step
            value = value.tensor
        if isinstance(value, StepInt):  # self.log("step", self.global_step): the graph computes it every step
            value = value._watch.lift(value).to(torch.get_default_dtype())
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise CaptureError(
                    f"{self.module_name}.training_step logs {name!r}, a tensor of shape {tuple(value.shape)}; "
                    "Lightning logs one number per key: log a scalar (e.g. its mean), or one key per element"
                )
            self.calls.append(LogCall(name, self._output_of(value), None, options))
            return
        if isinstance(value, (bool, int, float)):
            self.calls.append(LogCall(name, None, value, options))
            return
        raise CaptureError(
            f"{self.module_name}.training_step logs {name!r} = a {type(value).__name__}: NnScalerStrategy computes "
            "logged values inside the captured step, which can log tensors and numbers only. Log the tensor the "
            "metric computes (e.g. torchmetrics.functional.accuracy(preds, target, ...)) instead of a Metric object"
        )

    def _output_of(self, tensor: torch.Tensor) -> int:
        for index, seen in enumerate(self.tensors):
            if seen is tensor:
                return index + 1
        self.tensors.append(tensor)
        return len(self.tensors)

    def outputs(self, loss: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The step's outputs: the loss, then each other logged tensor once; a logged loss refers to output 0."""
        kept = [tensor for tensor in self.tensors if tensor is not loss]
        position = {
            index + 1: 0 if tensor is loss else next(k + 1 for k, other in enumerate(kept) if other is tensor)
            for index, tensor in enumerate(self.tensors)
        }
        self.calls = [call if call.output is None else replace(call, output=position[call.output]) for call in self.calls]
        self.metrics.calls = [
            replace(call, arguments=_moved(call.arguments, position), keywords=tuple((key, _moved((argument,), position)[0]) for key, argument in call.keywords))
            for call in self.metrics.calls
        ]
        self.tensors = kept
        return (loss, *kept)


def _moved(arguments: tuple[tuple[str, Any], ...], position: dict[int, int]) -> tuple[tuple[str, Any], ...]:
    return tuple((kind, position[value]) if kind == "output" else (kind, value) for kind, value in arguments)


def _signature(module: torch.nn.Module, method: str) -> inspect.Signature | None:
    bound: Callable[..., Any] | None = getattr(module, method, None)
    if bound is None:
        return None
    try:
        return inspect.signature(bound)
    except (TypeError, ValueError):
        return None


def _options(signature: inspect.Signature | None, args: tuple, kwargs: dict[str, Any], own: tuple[str, ...]) -> dict[str, Any]:
    """The call's keyword options by Lightning's parameter names (positional options bound to their names)."""
    if signature is None:
        return dict(kwargs)
    try:
        arguments = signature.bind(*args, **kwargs).arguments
    except TypeError as error:
        raise CaptureError(f"training_step calls log with arguments that do not fit its signature: {error}") from error
    options = {name: value for name, value in arguments.items() if name not in own}
    extra = options.pop("kwargs", None)
    if isinstance(extra, dict):
        options.update(extra)
    return options
