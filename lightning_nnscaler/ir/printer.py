"""The text form of a Graph, and its parser: ``Graph.from_text(str(graph))`` gives the graph back.

```
tensor %x: float32[4, 8] input
tensor %p_weight: float32[16, 8] parameter "layer.weight" grad
tensor %y: float32[4, 16] activation
op linear.0 @0 from linear recompute 1 = aten.linear.default(%x[0:2, 0:8], %p_weight) -> %y[0:2, 0:16] :: "b k+, n k+ -> b n; value 0"
output %y
order linear.0 -> linear.1
```
Pieces print their index box ``[start:stop, ...]`` unless whole, and their value share ``{k/n}``
unless whole. Constant arguments print as Python literals. Lifted constant values are not printed.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Callable

import torch

from lightning_nnscaler.ir.errors import NnScalerError
from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir.op import Argument, Op
from lightning_nnscaler.ir.tensor import TENSOR_ROLES, IndexMask, PTensor, ValueMask, VTensor

_NAME = r"[A-Za-z_][\w.]*"
_TENSOR_LINE = re.compile(rf'^tensor %({_NAME}): (\w+)\[([\d, ]*)\] (\w+)(?: "([^"]*)")?( grad)?$')
_OP_LINE = re.compile(rf"^op ({_NAME})(?: @(\d+))?( nograd)?(?: from ({_NAME}))?(?: recompute (\d+))?(?: segment (-?\d+)\.(\d+))? = ({_NAME})\((.*)\) -> (.*)$")
_REFERENCE = re.compile(rf"%({_NAME})(\[[\d:, ]*\])?(\{{\d+/\d+\}})?")


class IRParseError(NnScalerError, ValueError):
    """The text is not a graph's text form."""


def format_argument(value: Argument, leaf: Callable[[Any], str | None] | None = None) -> str:
    """One argument as text: pieces as references, constants as Python literals.

    ``leaf`` may render some values its own way (returning None for the rest); codegen uses it
    for variable names, the rank's device and non-finite floats.
    """
    text = leaf(value) if leaf is not None else None
    if text is not None:
        return text
    if isinstance(value, VTensor):
        return str(value)
    if isinstance(value, (list, tuple)):
        inner = ", ".join(format_argument(item, leaf) for item in value)
        if isinstance(value, list):
            return f"[{inner}]"
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, torch.device):
        return f"torch.device({str(value)!r})"
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # 'inf', '-inf', 'nan' are names in the parser's namespace
    return repr(value)


def format_op(op: Op) -> str:
    """One op as a line of text."""
    arguments = [format_argument(arg) for arg in op.args]
    arguments += [f"{key}={format_argument(value)}" for key, value in op.kwargs]
    head = f"op {op.name}"
    if op.device is not None:
        head += f" @{op.device}"
    if op.no_grad:
        head += " nograd"
    if op.origin is not None:
        head += f" from {op.origin}"
    if op.recompute is not None:
        head += f" recompute {op.recompute}"
    if op.segment is not None:
        head += f" segment {op.segment[0]}.{op.segment[1]}"
    line = f"{head} = {op.target}({', '.join(arguments)}) -> {', '.join(map(str, op.outputs))}"
    if op.annotation is not None:
        line += f" :: {json.dumps(op.annotation)}"
    return line


def format_tensor(tensor: PTensor) -> str:
    """One tensor declaration."""
    line = f"tensor %{tensor.name}: {tensor.dtype}[{', '.join(map(str, tensor.shape))}] {tensor.role}"
    if tensor.state_key is not None:
        line += f' "{tensor.state_key}"'
    if tensor.requires_grad:
        line += " grad"
    return line


def format_graph(graph: Graph) -> str:
    """The whole graph as text."""
    lines = [format_tensor(tensor) for tensor in graph.tensors.values()]
    lines += [format_op(op) for op in graph.ops]
    lines += [f"output %{name}" for name in graph.outputs]
    lines += [f"order {before} -> {after}" for before, after in graph.order_edges]
    return "\n".join(lines) + "\n"


def parse_graph(text: str) -> Graph:
    """Parse ``format_graph``'s text."""
    graph = Graph()
    for number, raw_line in enumerate(text.splitlines(), start=1):
        line = raw_line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            _parse_line(graph, line)
        except IRParseError as error:
            raise IRParseError(f"line {number}: {error}\n  {line}") from None
    return graph


def _parse_line(graph: Graph, line: str) -> None:
    keyword = line.split(" ", 1)[0]
    if keyword == "tensor":
        tensor = _parse_tensor(line)
        graph.tensors[tensor.name] = tensor
        if tensor.role != "activation":
            graph.inputs.append(tensor.name)
    elif keyword == "op":
        graph.add_op(_parse_op(graph, line))
    elif keyword == "output":
        graph.outputs.append(line.split("%", 1)[1].strip())
    elif keyword == "order":
        before, after = (part.strip() for part in line[len("order ") :].split("->"))
        graph.order_edges.append((before, after))
    else:
        raise IRParseError(f"unknown line kind {keyword!r}")


def _parse_tensor(line: str) -> PTensor:
    match = _TENSOR_LINE.match(line)
    if match is None:
        raise IRParseError("expected 'tensor %name: dtype[shape] role [\"state key\"] [grad]'")
    name, dtype, shape_text, role, state_key, grad = match.groups()
    if role not in TENSOR_ROLES:
        raise IRParseError(f"unknown tensor role {role!r}")
    shape = tuple(int(size) for size in shape_text.split(",") if size.strip())
    return PTensor(name, shape, dtype, role, state_key, bool(grad))  # type: ignore[arg-type]


def _parse_op(graph: Graph, line: str) -> Op:
    body, separator, annotation = line.rpartition(' :: "')
    if not separator:
        body, annotation = line, None
    match = _OP_LINE.match(body)
    if match is None:
        raise IRParseError("expected 'op name [@device] [nograd] [from origin] [recompute group] [segment stage.microbatch] = target(args) -> outputs [:: \"annotation\"]'")
    name, device, no_grad, origin, recompute, stage, microbatch, target, arguments_text, outputs_text = match.groups()
    args, kwargs = _evaluate(graph, f"_call({arguments_text})")
    outputs = _evaluate(graph, f"({outputs_text},)") if outputs_text.strip() else ()
    return Op(
        name=name,
        target=target,
        args=tuple(args),
        kwargs=tuple(kwargs.items()),
        outputs=tuple(outputs),
        annotation=None if annotation is None else json.loads('"' + annotation),
        device=None if device is None else int(device),
        no_grad=bool(no_grad),
        origin=origin,
        recompute=None if recompute is None else int(recompute),
        segment=None if stage is None else (int(stage), int(microbatch)),
    )


def _evaluate(graph: Graph, expression: str) -> Any:
    references: list[VTensor] = []

    def to_placeholder(match: re.Match[str]) -> str:
        references.append(_reference(graph, *match.groups()))
        return f"_ref({len(references) - 1})"

    python = _REFERENCE.sub(to_placeholder, expression)
    namespace = {
        "torch": torch,
        "inf": math.inf,
        "nan": math.nan,
        "_ref": references.__getitem__,
        "_call": lambda *args, **kwargs: (args, kwargs),
    }
    try:
        return eval(python, {"__builtins__": {}}, namespace)  # noqa: S307 - the IR's own text
    except Exception as error:  # noqa: BLE001 - any syntax or name error is a parse error
        raise IRParseError(f"cannot read arguments: {error}") from None


def _reference(graph: Graph, name: str, ranges_text: str | None, value_text: str | None) -> VTensor:
    if name not in graph.tensors:
        raise IRParseError(f"tensor %{name} is used before its 'tensor' line")
    tensor = graph.tensors[name]
    index = IndexMask.full(tensor.shape)
    if ranges_text:
        pairs = [part.split(":") for part in ranges_text.strip("[]").split(",") if part.strip()]
        index = IndexMask(tuple((int(start), int(stop)) for start, stop in pairs))
    value = ValueMask()
    if value_text:
        part, parts = value_text.strip("{}").split("/")
        value = ValueMask(int(part), int(parts))
    return VTensor(tensor, index, value)
