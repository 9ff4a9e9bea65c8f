"""Capture: a module (or a LightningModule's training step) plus example inputs -> IR Graph.

``torch.export`` (non-strict) produces an ATen graph; ``convert`` then turns it into the IR:
parameters and buffers become named graph inputs that keep their ``state_dict`` keys, regions run
under ``torch.no_grad()`` become ops marked ``no_grad``, in-place ops become their out-of-place
forms, and means are rewritten as sum / count so that a split batch stays exact. A training step is
traced once and run every step, so the Python values it would freeze are refused or recorded for a
check before each step (``step_values``).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils import _pytree as pytree

from lightning_nnscaler.capture.causal_masks import causal_masks_known
from lightning_nnscaler.capture.convert import CaptureError, convert
from lightning_nnscaler.capture.empty_caches import drop_empty_concatenations
from lightning_nnscaler.capture.items import item_values
from lightning_nnscaler.capture.logs import LogCall, LogRecorder
from lightning_nnscaler.capture.meta_module import traced_as_on
from lightning_nnscaler.capture.metrics import MetricCall
from lightning_nnscaler.capture.packed_qkv import split_packed_qkv
from lightning_nnscaler.capture.step_values import StepValues, StepWatch, watch_step
from lightning_nnscaler.capture.sync_batch_norm import sync_batch_norm_traced
from lightning_nnscaler.ir.graph import Graph


EVALUATION_STEPS = ("validation_step", "test_step")
"""The evaluation steps a plan can run forward-only over the training plan's pieces."""


class _TrainingStep(nn.Module):
    """Exposes ``<step>(batch, batch_idx, *extra)`` as ``forward(batch)`` returning the loss tensor (for an
    evaluation step, `_evaluation_output`'s scalar) and then each tensor the step logs (``logs``);
    ``batch_idx`` (0) and the torch calls are watched by ``watch`` (``step_values``)."""

    def __init__(self, module: nn.Module, watch: StepWatch, logs: LogRecorder, step: str = "training_step", extra: tuple = ()) -> None:
        super().__init__()
        self.module = module
        self.watch = watch
        self.logs = logs
        self.step = step
        self.extra = extra

    def forward(self, batch: Any) -> tuple[torch.Tensor, ...]:
        self.logs.reset()
        with self.watch.torch_calls(), item_values(), _logging_to(self.module, self.logs), self.logs.metrics.recording():
            output = getattr(self.module, self.step)(batch, self.watch.batch_idx, *self.extra)
            if self.step == "training_step":
                return self.logs.outputs(_loss_of(output, type(self.module).__name__))
            first, self.logs.returned = _evaluation_output(output, self.logs, f"{type(self.module).__name__}.{self.step}")
            return self.logs.outputs(first)


def _evaluation_output(output: Any, logs: LogRecorder, where: str) -> tuple[torch.Tensor, str]:
    """An evaluation step's first graph output and what the step returned: ``"value"`` (a number, returned as
    computed) or ``"none"`` (its first logged number stands in, so the graph has an output to run for).

    Raises:
        CaptureError: the step returns something other than a number or None, or neither returns nor logs a number.
    """
    if isinstance(output, dict) and set(output) == {"loss"}:
        output = output["loss"]
    if isinstance(output, torch.Tensor) and output.numel() == 1 and output.is_floating_point():
        return output, "value"
    if output is not None:
        raise CaptureError(f"{where} returns a {type(output).__name__}: a plan runs evaluation steps that return a number or None")
    numbers = [tensor for tensor in logs.tensors if tensor.numel() == 1 and tensor.is_floating_point()]
    if not numbers:
        raise CaptureError(f"{where} neither returns nor logs a number: nothing for a plan to compute")
    return numbers[0], "none"


def _loss_of(output: Any, module_name: str) -> torch.Tensor:
    """The loss ``training_step`` returned, refused as Lightning's automatic optimization would refuse it."""
    if isinstance(output, dict):
        if "loss" not in output:
            raise CaptureError(
                f"{module_name}.training_step returned a dict with the keys {sorted(map(str, output))} and no 'loss': "
                "Lightning's automatic optimization takes the loss from the 'loss' key; return {'loss': loss, ...}"
            )
        output = output["loss"]
    if not isinstance(output, torch.Tensor):
        raise CaptureError(f"{module_name}.training_step returned {type(output).__name__}; it must return the loss tensor or a dict with a 'loss' tensor")
    if output.numel() != 1:
        raise CaptureError(
            f"{module_name}.training_step returned a loss of shape {tuple(output.shape)}: backward needs a single number "
            "(under ddp loss.backward() raises 'grad can be implicitly created only for scalar outputs'). Reduce it, e.g. "
            "loss.mean(), or F.cross_entropy(..., reduction='mean')"
        )
    return output


class _Forward(nn.Module):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any) -> Any:
        return self.module(*args)


def trace(module: nn.Module, example_args: Any, *, step: str | None = None) -> Graph:
    """Capture ``module`` into an IR Graph.

    Args:
        module: Any ``nn.Module``; for a LightningModule pass ``step="training_step"`` to capture
            the computation from a batch to the loss.
        example_args: A tuple of positional arguments for ``forward``, or the batch when ``step``
            is given. Tensors may be nested in tuples, lists and dicts.
        step: ``None`` to capture ``forward``, or ``"training_step"``.

    Returns:
        The graph; its user inputs follow ``flatten_inputs(example_args)``.

    Raises:
        CaptureError: naming the submodule whose code could not be captured and what to change.
        FrozenValueError: ``training_step`` assigns a plain attribute (see ``trace_training_step``).
    """
    if step not in (None, "training_step", *EVALUATION_STEPS):
        raise CaptureError(f"step={step!r} is not supported; use None (forward), 'training_step', 'validation_step' or 'test_step'")
    if step == "training_step":
        return trace_training_step(module, example_args)[0]
    if step is not None:
        return loss_only(trace_step(module, example_args, step=step).graph)
    wrapper = _Forward(module)
    args = tuple(example_args) if isinstance(example_args, (tuple, list)) else (example_args,)
    _check_forward_takes(module, args)
    return convert(_export(wrapper, args, module), dict(wrapper.named_parameters(remove_duplicate=False)), prefix="module.")


@dataclass
class TracedStep:
    """A captured ``training_step``: its graph (outputs: the loss, then the logged tensors), the plain
    attributes it read (checked before each later step) and its ``self.log`` calls."""

    graph: Graph
    step_values: StepValues
    logs: list[LogCall]
    metric_calls: list[MetricCall] = field(default_factory=list)
    returned: str = "loss"
    """``"loss"`` (training), or what an evaluation step returned: ``"value"`` (graph output 0) or ``"none"``."""


def trace_training_step(module: nn.Module, batch: Any) -> tuple[Graph, StepValues]:
    """Capture ``module.training_step(batch, batch_idx)`` into an IR Graph, watching the Python
    values the captured step would freeze (``capture.step_values``).

    Returns:
        The graph (user inputs follow ``flatten_inputs(batch, step="training_step")``; its output is
        the loss) and its `StepValues`: the plain attributes the step read, whose ``check(module)`` must
        pass before each later step, and its guards and lifted constants on per-step values
        (``capture.step_symbols``). ``trace_step`` also keeps what the step logs.

    Raises:
        FrozenValueError: the step assigns a plain attribute; naming it and the fix.
        CaptureError: naming the submodule whose code could not be captured and what to change.
    """
    traced = trace_step(module, batch)
    return loss_only(traced.graph), traced.step_values


def trace_step(module: nn.Module, batch: Any, batch_idx: int = 0, *, step: str = "training_step", extra: tuple = ()) -> TracedStep:
    """``trace_training_step`` with the step's ``self.log`` / ``self.log_dict`` calls (``capture.logs``), at
    ``batch_idx`` (and the Trainer's step and epoch): its guards are the decisions made at these values.
    ``step`` may be an evaluation step (``EVALUATION_STEPS``), called with ``extra`` after ``batch_idx``
    (a ``dataloader_idx``)."""
    logs = LogRecorder(module)
    with watch_step(module, batch_idx) as watch:
        wrapper = _TrainingStep(module, watch, logs, step, extra)
        try:
            exported = _export(wrapper, (batch,), module)
        except CaptureError as error:
            watch.raise_if_frozen(cause=error)  # a frozen value is the likelier root cause
            raise
    watch.raise_if_frozen()
    graph = convert(exported, dict(wrapper.named_parameters(remove_duplicate=False)), prefix="module.")
    return TracedStep(graph, watch.step_values(graph.constant_values), list(logs.calls), list(logs.metrics.calls), logs.returned)


def loss_only(graph: Graph) -> Graph:
    """``graph`` (a traced step) with the loss as its only output, without the ops only its logged values needed."""
    unneeded = needed_ops(graph, graph.outputs) - needed_ops(graph, graph.outputs[:1])
    graph.outputs = graph.outputs[:1]
    if unneeded:
        graph.ops = [op for op in graph.ops if op.name not in unneeded]
    return graph


def needed_ops(graph: Graph, outputs: list[str]) -> set[str]:
    """Names of the ops that the tensors ``outputs`` depend on."""
    producers = {output.name: op for op in graph.ops for output in op.outputs}
    needed: set[str] = set()
    stack = [name for name in outputs if name in producers]
    while stack:
        op = producers[stack.pop()]
        if op.name not in needed:
            needed.add(op.name)
            stack.extend(piece.name for piece in op.tensor_inputs if piece.name in producers)
    return needed


def _export(wrapper: nn.Module, args: tuple[Any, ...], module: nn.Module) -> torch.export.ExportedProgram:
    """``torch.export`` (non-strict) of ``wrapper``; a failure names ``module``'s innermost submodule."""
    module_paths = {id(sub): name or type(module).__name__ for name, sub in module.named_modules()}
    with _silenced_logging(module), causal_masks_known(), sync_batch_norm_traced(), traced_as_on(module, args) as traced_args:
        try:
            return split_packed_qkv(drop_empty_concatenations(torch.export.export(wrapper, traced_args, strict=False)))
        except CaptureError:
            raise
        except Exception as error:  # noqa: BLE001 - every export failure gets the module path
            raise CaptureError(_explain(error, module_paths, type(module).__name__)) from error


def flatten_inputs(example_args: Any, *, step: str | None = None) -> list[torch.Tensor]:
    """The tensors of ``example_args`` in the order of the traced graph's user inputs."""
    args = (example_args,) if step is not None else (
        tuple(example_args) if isinstance(example_args, (tuple, list)) else (example_args,)
    )
    leaves, _ = pytree.tree_flatten(args)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


@contextlib.contextmanager
def _silenced_logging(module: nn.Module) -> Iterator[None]:
    """LightningModule.log needs a Trainer; tracing runs without one, so logging is a no-op here
    (``trace_step`` records the step's calls inside this, with `_logging_to`)."""
    with _logging_to(module, None):
        yield


@contextlib.contextmanager
def _logging_to(module: nn.Module, recorder: LogRecorder | None) -> Iterator[None]:
    """``module.log`` / ``module.log_dict`` go to ``recorder`` (nowhere when None) inside the block."""
    patched = [name for name in ("log", "log_dict") if hasattr(module, name)]
    own = {name: module.__dict__[name] for name in patched if name in module.__dict__}
    for name in patched:
        setattr(module, name, getattr(recorder, name) if recorder is not None else (lambda *args, **kwargs: None))
    try:
        yield
    finally:
        for name in patched:
            if name in own:
                setattr(module, name, own[name])
            else:
                delattr(module, name)


def _check_forward_takes(module: nn.Module, args: tuple[Any, ...]) -> None:
    """Refuse, before tracing, example arguments that ``module.forward`` cannot take (a wrong ``step``)."""
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):  # a builtin or C-implemented forward: let torch.export judge
        return
    try:
        signature.bind(*args)
    except TypeError as error:
        given = ", ".join(type(arg).__name__ for arg in args)
        hint = (
            f" {type(module).__name__} has a training_step: to capture training_step(batch, batch_idx) from a batch, "
            'pass step="training_step".'
            if callable(getattr(module, "training_step", None)) else ""
        )
        parameters = ", ".join(str(parameter.replace(annotation=inspect.Parameter.empty, default=inspect.Parameter.empty))
                               for parameter in signature.parameters.values())
        raise CaptureError(
            f"cannot capture {type(module).__name__}.forward({parameters}): the example arguments ({given}) are passed to it "
            f"as positional arguments, and {error}.{hint}"
        ) from None


def _explain(error: Exception, module_paths: dict[int, str], module_name: str) -> str:
    detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    location = _innermost_user_module(error, module_paths) or module_name
    return (
        f"cannot capture module {location!r}: {type(error).__name__}: {detail}\n"
        "torch.export runs the code with symbolic tensors: Python control flow on tensor values "
        "(if/while on a tensor, .item(), .tolist(), numpy conversions) cannot be captured. "
        "Use torch.where or torch.cond instead, or move that code out of the traced step."
    )


def _innermost_user_module(error: BaseException, module_paths: dict[int, str]) -> str | None:
    """The path of the deepest user module whose code was running when capture failed."""
    found = None
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        traceback = current.__traceback__
        while traceback is not None:
            frame_self = traceback.tb_frame.f_locals.get("self")
            if isinstance(frame_self, nn.Module) and id(frame_self) in module_paths:
                found = module_paths[id(frame_self)]
            traceback = traceback.tb_next
        current = current.__cause__ or current.__context__
    return found


def bind_inputs(graph: Graph, module: nn.Module, example_args: Any, *, step: str | None = None) -> dict[str, torch.Tensor]:
    """Values for every graph input: the module's parameters and buffers, then the example tensors.

    Raises:
        CaptureError: when the module no longer has a parameter/buffer the graph names, or the
            example inputs do not match the traced ones in number.
    """
    state = dict(module.named_parameters(remove_duplicate=False))
    state.update(dict(module.named_buffers(remove_duplicate=False)))
    values: dict[str, torch.Tensor] = {}
    for name in graph.inputs:
        tensor = graph.tensors[name]
        if tensor.role in ("parameter", "buffer"):
            if tensor.state_key not in state:
                raise CaptureError(f"graph input %{name} is {tensor.role} {tensor.state_key!r}, which the module does not have")
            values[name] = state[tensor.state_key]
        elif tensor.role == "constant":
            values[name] = graph.constant_values[name]
    user_inputs = graph.user_inputs
    given = flatten_inputs(example_args, step=step)
    if len(given) != len(user_inputs):
        raise CaptureError(f"the graph takes {len(user_inputs)} input tensors, {len(given)} were given")
    values.update({tensor.name: value for tensor, value in zip(user_inputs, given)})
    return values
