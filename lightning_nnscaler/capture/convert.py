"""Convert a ``torch.export`` program into the IR Graph (see ``trace``)."""

from __future__ import annotations

import math
import operator
from dataclasses import replace
from typing import Any

import torch
from torch import fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from lightning_nnscaler.capture.packed import FlattenedLinear, HeadView, PackedProjection, flattened_linears, head_views, packed_projections
from lightning_nnscaler.capture.random_ops import RANDOM_HANDLERS
from lightning_nnscaler.capture.sync_batch_norm import decompose_sync_batch_norm, from_sync_batch_norm
from lightning_nnscaler.ir.errors import NnScalerError
from lightning_nnscaler.ir.rules import annotate_op
from lightning_nnscaler.ir.rules.batch_norm import BATCH_NORM, FUNCTIONAL_BATCH_NORM
from lightning_nnscaler.ir.rules.networks import POINTWISE_LOSSES
from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir.op import Op
from lightning_nnscaler.ir.tensor import IndexMask, PTensor, VTensor


class CaptureError(NnScalerError, RuntimeError):
    """The model (or part of it) cannot be captured into the IR; the message says what to change."""


_ROLE = {
    InputKind.PARAMETER: "parameter",
    InputKind.BUFFER: "buffer",
    InputKind.CONSTANT_TENSOR: "constant",
    InputKind.USER_INPUT: "input",
}
_DROPPED = {"aten._assert_tensor_metadata.default", "aten._assert_scalar.default", "aten.sym_constrain_range_for_size.default"}
_SAME_AS = {"aten.lift_fresh_copy.default": "aten.clone.default", "aten.detach_.default": "aten.detach.default"}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _Converter:
    def __init__(self, exported: ExportedProgram, named_parameters: dict[str, torch.nn.Parameter], prefix: str) -> None:
        self.exported = exported
        self.named_parameters = named_parameters
        self.prefix = prefix
        self.graph = Graph()
        self.values: dict[fx.Node, Any] = {}
        self.op_names: set[str] = set()
        self.view_bases: dict[fx.Node, fx.Node] = {}
        self.rewrites: dict[fx.Node, PackedProjection | HeadView | FlattenedLinear] = {}
        self.skipped: set[fx.Node] = set()
        self.input_names: dict[fx.Node, str] = {}
        self.alias_of: dict[fx.Node, fx.Node] = {}
        """The result of an in-place op -> the tensor it changed (``ema.mul_(0.9).add_(x)`` adds to ``ema``)."""

    def unique(self, name: str, taken: Any) -> str:
        candidate, index = name, 1
        while candidate in taken:
            candidate, index = f"{name}_{index}", index + 1
        return candidate

    def add_tensor(self, name: str, value: torch.Tensor, role: str = "activation", **fields: Any) -> VTensor:
        tensor = PTensor(self.unique(name, self.graph.tensors), tuple(int(s) for s in value.shape), _dtype_name(value.dtype), role, **fields)  # type: ignore[arg-type]
        self.graph.tensors[tensor.name] = tensor
        return tensor.full()

    def run(self) -> Graph:
        signature = self.exported.graph_signature
        specs = {spec.arg.name: spec for spec in signature.input_specs if hasattr(spec.arg, "name")}
        self.plan_rewrites({node for node in self.exported.graph.nodes if node.op == "placeholder" and specs[node.name].kind == InputKind.PARAMETER})
        for node in self.exported.graph.nodes:
            if node.op == "placeholder":
                self.placeholder(node, specs[node.name])
            elif node.op == "call_function":
                self.call(node, self.exported.graph_module, no_grad=False)
            elif node.op == "output":
                self.output(node, signature)
        self.record_buffer_updates(specs)
        return self.graph

    def record_buffer_updates(self, specs: dict[str, Any]) -> None:
        """Each buffer the step wrote in place, with the tensor holding its last value (``Graph.buffer_updates``)."""
        for node in self.exported.graph.nodes:
            if node.op != "placeholder" or specs[node.name].kind != InputKind.BUFFER:
                continue
            value = self.values[node]
            if isinstance(value, VTensor) and value.name != self.input_names[node]:
                if not value.is_full:
                    raise CaptureError(f"buffer {specs[node.name].target!r} is written as a box of {value.name!r}; write it as a whole tensor")
                self.graph.buffer_updates[self.input_names[node]] = value.name

    def plan_rewrites(self, parameters: set[fx.Node]) -> None:
        """Find the packed q/k/v projections and ``B·H`` head views to capture by heads, and the linears over
        merged leading dims to capture with the batch apart (see ``capture.packed``)."""
        graph = self.exported.graph
        for rewrite in [*packed_projections(graph, parameters), *head_views(graph), *flattened_linears(graph)]:
            first = rewrite.first if isinstance(rewrite, HeadView) else rewrite.linear  # where every input it reads is known
            self.rewrites[first] = rewrite
            self.skipped.update(rewrite.skipped)
            if isinstance(rewrite, PackedProjection):
                self.skipped.update(rewrite.parts)

    def packed_projection(self, projection: PackedProjection, no_grad: bool) -> None:
        """One linear per part, each reading its rows of the packed weight and bias."""
        node, size = projection.linear, projection.size
        inputs = [self.values[arg] for arg in node.args[:3]]
        source, weight, bias = (inputs + [None])[:3]
        for index, part in enumerate(projection.parts):
            rows = (index * size, (index + 1) * size)
            arguments = [source, _rows(weight, rows)] + ([_rows(bias, rows)] if bias is not None else [])
            self.values[part] = self.emit(f"{node.name}_{'qkv'[index] if len(projection.parts) == 3 else index}", "aten.linear.default", arguments, {}, part.meta["val"], no_grad)

    def head_view(self, chain: HeadView, no_grad: bool) -> None:
        """``view(L, B, H, D).permute(1, 2, 0, 3)`` in place of the ``B·H`` views."""
        source = self.values[chain.first.args[0]]
        value = chain.first.meta["val"]
        heads = self.emit(chain.first.name, "aten.view.default", [source, list(chain.heads_shape)], {}, value.new_empty(chain.heads_shape), no_grad)
        self.values[chain.last] = self.emit(f"{chain.first.name}_heads", "aten.permute.default", [heads, [1, 2, 0, 3]], {}, chain.last.meta["val"], no_grad)

    def flattened_linear(self, chain: FlattenedLinear, no_grad: bool) -> None:
        """``linear(x.reshape(*lead, E))`` in place of the reshape to ``(prod(lead), E)``, the linear and the view back."""
        source = self.values[chain.first.args[0]]
        value = chain.first.meta["val"]
        target = _SAME_AS.get(str(chain.first.target), str(chain.first.target))
        kept = self.emit(chain.first.name, target, [source, list(chain.kept_shape)], {}, value.new_empty(chain.kept_shape), no_grad)
        arguments = [kept, *_plain(fx.node.map_arg(chain.linear.args[1:], self.values.__getitem__))]
        keywords = _plain(fx.node.map_arg(chain.linear.kwargs, self.values.__getitem__))
        self.values[chain.last] = self.emit(chain.linear.name, "aten.linear.default", arguments, keywords, chain.last.meta["val"], no_grad)

    def placeholder(self, node: fx.Node, spec: Any) -> None:
        role = _ROLE.get(spec.kind)
        if role is None:
            raise CaptureError(f"graph input {node.name!r} of kind {spec.kind.name} is not supported")
        value = node.meta["val"]
        if not isinstance(value, torch.Tensor):
            raise CaptureError(f"input {node.name!r} is a {type(value).__name__}; only tensors can be graph inputs")
        key = spec.target.removeprefix(self.prefix) if spec.target else None
        requires_grad = role == "parameter" and self.named_parameters[spec.target].requires_grad
        piece = self.add_tensor(node.name, value, role, state_key=key if role in ("parameter", "buffer") else None, requires_grad=requires_grad)
        if role == "constant":
            self.graph.constant_values[piece.name] = self.exported.constants[spec.target]
        self.graph.inputs.append(piece.name)
        self.values[node] = piece
        self.input_names[node] = piece.name

    def output(self, node: fx.Node, signature: Any) -> None:
        returned = node.args[0]
        for spec, value in zip(signature.output_specs, returned):
            if spec.kind != OutputKind.USER_OUTPUT:
                continue  # a buffer mutation is recorded from its in-place ops (``record_buffer_updates``)
            piece = self.values.get(value) if isinstance(value, fx.Node) else None
            if not isinstance(piece, VTensor):
                raise CaptureError(f"the traced function returns {value!r}; only tensors can be outputs")
            self.graph.outputs.append(piece.name)

    def call(self, node: fx.Node, owner: fx.GraphModule, no_grad: bool) -> None:
        if node in self.skipped:
            return
        rewrite = self.rewrites.get(node)
        if rewrite is not None:
            handlers = {PackedProjection: self.packed_projection, HeadView: self.head_view, FlattenedLinear: self.flattened_linear}
            handlers[type(rewrite)](rewrite, no_grad)  # type: ignore[operator]
            return
        if node.target is operator.getitem:
            self.values[node] = self.values[node.args[0]][node.args[1]]
            return
        if node.target is torch.ops.higher_order.wrap_with_set_grad_enabled:
            enabled, submodule_node, *operands = node.args
            self.values[node] = self.inline(getattr(owner, submodule_node.target), operands, no_grad=no_grad or not enabled)
            return
        if not isinstance(node.target, torch._ops.OpOverload):
            raise CaptureError(f"op {node.name!r} calls {node.target!r}, which the IR cannot represent; write it with torch operators")
        target = _SAME_AS.get(str(node.target), str(node.target))
        if target in _DROPPED:
            return
        args = fx.node.map_arg(node.args, self.values.__getitem__)
        kwargs = fx.node.map_arg(node.kwargs, self.values.__getitem__)
        args, kwargs = _plain(args), _plain(kwargs)
        random = RANDOM_HANDLERS.get(target)
        drawn = None if random is None else random(self, node, args, kwargs, no_grad)
        if drawn is not None:
            self.values[node] = drawn
            if node.target._schema.is_mutable:
                self.write_back(node, node.args[0], drawn, no_grad)
            return
        if node.target._schema.is_mutable and target == str(node.target):
            self.mutate(node, args, kwargs, no_grad)
            return
        decompose = _DECOMPOSITIONS.get(target)
        if decompose is not None and decompose(self, node, args, kwargs, no_grad):
            return
        self.values[node] = self.emit(node.name, target, args, kwargs, node.meta["val"], no_grad)
        if target in _SCATTER and isinstance(node.args[0], fx.Node):
            self.view_bases[node] = node.args[0]

    def emit(self, name: str, target: str, args: Any, kwargs: dict[str, Any], value: Any, no_grad: bool) -> Any:
        """Add one op; returns its output piece (or a tuple of them for tuple outputs)."""
        op_name = self.unique(name, self.op_names)
        self.op_names.add(op_name)
        if isinstance(value, torch.Tensor):
            outputs: tuple[VTensor, ...] = (self.add_tensor(op_name, value),)
            result: Any = outputs[0]
        elif isinstance(value, (tuple, list)) and all(isinstance(item, torch.Tensor) for item in value):
            outputs = tuple(self.add_tensor(f"{op_name}_{index}", item) for index, item in enumerate(value))
            result = outputs
        else:
            raise CaptureError(f"op {op_name!r} ({target}) returns {type(value).__name__}; only tensor results are supported")
        op = Op(name=op_name, target=target, args=tuple(args), kwargs=tuple(kwargs.items()), outputs=outputs, no_grad=no_grad)
        self.graph.add_op(replace(op, annotation=annotate_op(op)))
        return result

    def inline(self, submodule: fx.GraphModule, operands: list[Any], no_grad: bool) -> Any:
        placeholders = [node for node in submodule.graph.nodes if node.op == "placeholder"]
        for placeholder, operand in zip(placeholders, operands, strict=True):
            self.values[placeholder] = self.values[operand]
        for node in submodule.graph.nodes:
            if node.op == "call_function":
                self.call(node, submodule, no_grad)
            elif node.op == "output":
                return tuple(self.values[item] for item in node.args[0])
        raise CaptureError("a no_grad region has no output")

    def mutate(self, node: fx.Node, args: Any, kwargs: dict[str, Any], no_grad: bool) -> None:
        """An in-place op becomes its out-of-place form; the new value replaces the mutated tensor
        (and, through the views it was cut from, their bases) for every later reader."""
        packet = node.target.overloadpacket.__name__
        functional = getattr(getattr(torch.ops.aten, packet.rstrip("_"), None), node.target._overloadname, None)
        mutated = node.args[0]
        if functional is None or not packet.endswith("_") or not isinstance(mutated, fx.Node):
            raise CaptureError(f"op {node.name!r} ({node.target}) mutates a tensor in place; write it out of place")
        new_value = self.emit(node.name, str(functional), args, kwargs, node.meta["val"], no_grad)
        self.values[node] = new_value
        self.alias_of[node] = mutated
        self.write_back(node, mutated, new_value, no_grad)

    def write_back(self, mutation: fx.Node, target: fx.Node, new_value: VTensor, no_grad: bool, updated_view: fx.Node | None = None) -> None:
        if target.op == "placeholder" and self.graph.tensors[self.input_names[target]].role != "buffer":
            raise CaptureError(f"op {mutation.name!r} ({mutation.target}) changes graph input {target.name!r} in place; write it out of place")
        self._refuse_stale_views(mutation, target, updated_view)
        self.values[target] = new_value
        if target in self.alias_of:  # an in-place op's result is the tensor it changed
            self.write_back(mutation, self.alias_of[target], new_value, no_grad, updated_view)
            return
        base = self.view_bases.get(target)
        if base is None:
            return  # buffer updates (e.g. running statistics) stay local to the step
        scatter = _SCATTER.get(str(target.target))
        if scatter is None:
            raise CaptureError(f"op {mutation.name!r} ({mutation.target}) writes through a {target.target} view; write it out of place")
        scatter_target, scatter_args = scatter(self.values[base], new_value, list(target.args[1:]))
        new_base = self.emit(f"{target.name}_scatter", scatter_target, scatter_args, {}, base.meta["val"], no_grad)
        self.write_back(mutation, base, new_base, no_grad, updated_view=target)

    def _refuse_stale_views(self, mutation: fx.Node, target: fx.Node, updated_view: fx.Node | None) -> None:
        order = {candidate: index for index, candidate in enumerate(mutation.graph.nodes)}
        for view, base in self.view_bases.items():
            if base is target and view is not updated_view and view in self.values and any(order.get(user, -1) > order[mutation] for user in view.users):
                raise CaptureError(
                    f"op {mutation.name!r} ({mutation.target}) changes {target.name!r} in place while its view {view.name!r} "
                    "is read afterwards; write it out of place"
                )


def _rows(piece: VTensor, rows: tuple[int, int]) -> VTensor:
    """Rows ``[start, stop)`` of a piece (counted from its first row), as a box of its tensor."""
    first = piece.index.ranges[0][0]
    return replace(piece, index=IndexMask(((first + rows[0], first + rows[1]),) + piece.index.ranges[1:]))


def _decompose_parameter_split(converter: _Converter, node: fx.Node, args: Any, kwargs: dict, no_grad: bool) -> bool:
    """A split of a parameter (``w_q, w_kv = in_proj_weight.split([E, 2E])``; a packed ``Conv1D`` weight's
    columns, ``capture.packed_qkv``) is its boxes: no op."""
    source = args[0]
    if not isinstance(source, VTensor) or source.tensor.role != "parameter" or not source.is_full:
        return False
    dim = int(args[2] if len(args) > 2 else kwargs.get("dim", 0)) % len(source.shape)
    length = source.shape[dim]
    sizes = args[1] if isinstance(args[1], (list, tuple)) else [min(int(args[1]), length - start) for start in range(0, length, int(args[1]))]
    starts = [sum(sizes[:index]) for index in range(len(sizes))]
    ranges = source.index.ranges
    converter.values[node] = tuple(
        replace(source, index=IndexMask(ranges[:dim] + ((start, start + int(size)),) + ranges[dim + 1 :])) for start, size in zip(starts, sizes)
    )
    return True


def _slice_back(base: VTensor, value: VTensor, args: list[Any]) -> tuple[str, list[Any]]:
    dim, start, end, step = (args + [0, None, None, 1][len(args):])[:4]
    return "aten.slice_scatter.default", [base, value, dim, start, end, step]


def _select_back(base: VTensor, value: VTensor, args: list[Any]) -> tuple[str, list[Any]]:
    return "aten.select_scatter.default", [base, value, args[0], args[1]]


def _reshape_back(base: VTensor, value: VTensor, args: list[Any]) -> tuple[str, list[Any]]:
    return "aten.view.default", [value, list(base.shape)]


def _transpose_back(base: VTensor, value: VTensor, args: list[Any]) -> tuple[str, list[Any]]:
    return "aten.transpose.int", [value, args[0], args[1]]


def _permute_back(base: VTensor, value: VTensor, args: list[Any]) -> tuple[str, list[Any]]:
    order = [int(dim) % len(base.shape) for dim in args[0]]
    return "aten.permute.default", [value, [order.index(dim) for dim in range(len(order))]]


_SCATTER = {
    "aten.slice.Tensor": _slice_back,
    "aten.select.int": _select_back,
    "aten.view.default": _reshape_back,
    "aten._unsafe_view.default": _reshape_back,
    "aten.unsqueeze.default": _reshape_back,
    "aten.squeeze.dim": _reshape_back,
    "aten.squeeze.dims": _reshape_back,
    "aten.alias.default": _reshape_back,
    "aten.transpose.int": _transpose_back,
    "aten.permute.default": _permute_back,
}


def _plain(value: Any) -> Any:
    """fx's immutable containers as plain lists/dicts."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_plain(item) for item in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def _decompose_mean(converter: _Converter, node: fx.Node, args: Any, kwargs: dict, no_grad: bool) -> bool:
    source: VTensor = args[0]
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    if kwargs.get("dtype") is not None or not source.tensor.dtype.startswith(("float", "bfloat", "complex")):
        return False
    rank = len(source.shape)
    reduced = list(range(rank)) if not dims else sorted({int(d) % max(rank, 1) for d in dims})
    count = math.prod(source.shape[d] for d in reduced)
    value = node.meta["val"]
    total = converter.emit(f"{node.name}_sum", "aten.sum.dim_IntList", [source, reduced, keepdim], {}, value, no_grad)
    converter.values[node] = converter.emit(node.name, "aten.div.Scalar", [total, count], {}, value, no_grad)
    return True


def _decompose_cross_entropy(converter: _Converter, node: fx.Node, args: Any, kwargs: dict, no_grad: bool) -> bool:
    """mean cross-entropy = sum / (number of targets not ignored): both parts split exactly by batch."""
    names = ["self", "target", "weight", "reduction", "ignore_index", "label_smoothing"]
    defaults = {"weight": None, "reduction": 1, "ignore_index": -100, "label_smoothing": 0.0}
    bound = {**defaults, **dict(zip(names, args)), **kwargs}
    if bound["reduction"] != 1 or bound["weight"] is not None:
        return False
    value = node.meta["val"]
    summed_args = [bound["self"], bound["target"], None, 2, bound["ignore_index"], bound["label_smoothing"]]
    total = converter.emit(f"{node.name}_sum", node.target.__str__(), summed_args, {}, value, no_grad)
    target_meta = torch.empty(bound["target"].shape, dtype=torch.bool)
    kept = converter.emit(f"{node.name}_kept", "aten.ne.Scalar", [bound["target"], bound["ignore_index"]], {}, target_meta, no_grad)
    count = converter.emit(f"{node.name}_count", "aten.sum.default", [kept], {}, torch.empty((), dtype=torch.int64), no_grad)
    converter.values[node] = converter.emit(node.name, "aten.div.Tensor", [total, count], {}, value, no_grad)
    return True


def _decompose_pointwise_loss(converter: _Converter, node: fx.Node, args: Any, kwargs: dict, no_grad: bool) -> bool:
    """mean mse / l1 / smooth-l1 / huber / binary cross-entropy = the summed loss / its element count."""
    position = POINTWISE_LOSSES[str(node.target)]
    reduction = args[position] if len(args) > position else kwargs.get("reduction", 1)
    if reduction != 1:
        return False
    count = math.prod(torch.broadcast_shapes(*(arg.shape for arg in args if isinstance(arg, VTensor))))
    arguments, summed_kwargs = list(args), dict(kwargs)
    if len(args) > position:
        arguments[position] = 2
    else:
        summed_kwargs["reduction"] = 2
    value = node.meta["val"]
    total = converter.emit(f"{node.name}_sum", str(node.target), arguments, summed_kwargs, value, no_grad)
    converter.values[node] = converter.emit(node.name, "aten.div.Scalar", [total, count], {}, value, no_grad)
    return True


# ``template.new_zeros(size)`` and its kin take only dtype and device from the template.
_FACTORY_OF_TEMPLATE = {
    "aten.new_zeros.default": "aten.zeros.default",
    "aten.new_ones.default": "aten.ones.default",
    "aten.new_empty.default": "aten.empty.memory_format",
    "aten.new_full.default": "aten.full.default",
}


def _decompose_template_factory(converter: _Converter, node: fx.Node, args: Any, kwargs: dict, no_grad: bool) -> bool:
    """``template.new_zeros(size)`` as ``torch.zeros(size, dtype=..., device=...)``: the template is
    no input, or a rank would read it whole (T5 shifting its labels right reads every row)."""
    value = node.meta["val"]
    options = {**kwargs, "dtype": value.dtype, "device": value.device}
    factory = _FACTORY_OF_TEMPLATE[str(node.target)]
    converter.values[node] = converter.emit(node.name, factory, list(args[1:]), options, value, no_grad)
    return True


def _decompose_batch_norm(converter: _Converter, node: fx.Node, args: Any, kwargs: dict, no_grad: bool) -> bool:
    """A training-mode ``batch_norm`` that updates running statistics as its functional form, whose new
    running mean and variance are outputs (written back to the buffers after the step; ``ir.rules.batch_norm``)."""
    names = ["input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps"]
    bound = {**dict(zip(names, args)), **kwargs}
    statistics = [node.args[3] if len(node.args) > 3 else node.kwargs.get("running_mean"), node.args[4] if len(node.args) > 4 else node.kwargs.get("running_var")]
    if bound.get("training") and from_sync_batch_norm(node):
        return decompose_sync_batch_norm(converter, node, bound, statistics, no_grad)
    if not bound.get("training") or not all(isinstance(item, fx.Node) for item in statistics):
        return False
    value, channels = node.meta["val"], statistics[0].meta["val"]
    arguments = [bound[name] for name in names]
    outputs = converter.emit(node.name, FUNCTIONAL_BATCH_NORM, arguments, {}, (value, channels, channels, channels, channels), no_grad)
    converter.values[node] = outputs[0]
    for statistic, new_value in zip(statistics, outputs[3:]):
        converter.write_back(node, statistic, new_value, no_grad=True)
    return True


_DECOMPOSITIONS = {
    BATCH_NORM: _decompose_batch_norm,
    "aten.split_with_sizes.default": _decompose_parameter_split,
    "aten.split.Tensor": _decompose_parameter_split,
    **dict.fromkeys(_FACTORY_OF_TEMPLATE, _decompose_template_factory),
    "aten.mean.dim": _decompose_mean,
    "aten.mean.default": _decompose_mean,
    "aten.cross_entropy_loss.default": _decompose_cross_entropy,
    **dict.fromkeys(POINTWISE_LOSSES, _decompose_pointwise_loss),
}


def convert(exported: ExportedProgram, named_parameters: dict[str, torch.nn.Parameter], prefix: str = "") -> Graph:
    """Turn an exported program into the IR; ``prefix`` is stripped from state_dict keys."""
    return _Converter(exported, named_parameters, prefix).run()
