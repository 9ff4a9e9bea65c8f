"""Values a ``training_step`` logs, computed by the plan per data-parallel replica, as DDP computes them.

Under DDP each rank runs ``training_step`` on its replica's batch and logs what it computes there;
``sync_dist=True`` then averages over the ranks. The plan runs one graph over the whole batch (every
replica's rows), so a logged value is computed in two parts:

- **per-replica sums, in the graph.** Walking back from a logged tensor, the first ops that read a
  tensor holding one row per sample and write one that does not are its *frontier*: the reductions
  over the batch (``sum``; a mean, which capture writes as sum / count; a loss with
  ``reduction="sum"``). Each frontier reduction becomes a per-row reduction (the sum over every
  other dim, or the loss with ``reduction="none"``) followed by a product with a constant
  replica-indicator matrix: the result holds one sum per replica. A product's contracted dim splits
  exactly however a recipe splits the rows (replicas, microbatches, pipeline stages), so every plan
  computes these sums as value parts, which the runtime adds up over the ranks.
- **the rest, per replica, after the step** (the *tail*: ``sum / count``, ``torch.exp(loss)``,
  casts): small ops on one number per replica, evaluated by `LoggedValues.per_replica` with a
  leading replica dim. The tail's ops come from a trace of the step on *one replica's* batch, so a
  number the step takes from the batch's shape (``len(y)``, ``x.numel()``) is the replica's, as
  under DDP. Tensors that do not depend on the batch (a parameter's norm) are computed by the graph
  whole and shared by all replicas.

Each rank logs its own replica's values with the user's options, so Lightning reduces them exactly
as under DDP. A logged value the plan cannot compute this way is refused while planning, naming the
key and the op: `LoggedValueError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from lightning_nnscaler.capture.logs import LogCall
from lightning_nnscaler.capture.metrics import MetricCall
from lightning_nnscaler.capture.trace import needed_ops
from lightning_nnscaler.ir.errors import NnScalerError
from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir.interpret import call_op
from lightning_nnscaler.ir.op import Op, resolve_target
from lightning_nnscaler.ir.rules import annotate_op
from lightning_nnscaler.ir.rules.networks import POINTWISE_LOSSES
from lightning_nnscaler.ir.tensor import PTensor, VTensor
from lightning_nnscaler.plans.propagate import batch_dims


class LoggedValueError(NnScalerError, ValueError):
    """A value ``training_step`` logs that the plan cannot compute per replica; names the key and the op."""


_SUMS = ("aten.sum.default", "aten.sum.dim_IntList")
_LOSS_REDUCTION_POSITION = {  # loss ops: position of ``reduction`` (0 none, 1 mean, 2 sum) and of an input with the rows
    "aten.cross_entropy_loss.default": (3, 1), "aten.nll_loss_nd.default": (3, 1), "aten.nll_loss.default": (3, 1),
    **{target: (position, 0) for target, position in POINTWISE_LOSSES.items()},
}
_SHAPE_OPS = frozenset({
    "aten.view.default", "aten.reshape.default", "aten._unsafe_view.default", "aten.squeeze.default", "aten.squeeze.dim",
    "aten.squeeze.dims", "aten.unsqueeze.default", "aten.flatten.using_ints",
})
_ANY_SHAPE_OPS = frozenset({
    "aten.detach.default", "aten.alias.default", "aten.clone.default", "aten.contiguous.default", "aten._to_copy.default",
    "aten.to.dtype", "aten.to.dtype_layout", "aten.lift_fresh_copy.default",
})


@dataclass
class FrontierSum:
    """A frontier reduction: the graph output holding its per-replica sums, and the reduction's own shape and dtype."""

    output: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class LoggedValues:
    """What a planned step logs, and how each rank gets its replica's values from the step's outputs."""

    calls: list[LogCall]
    replicas: int = 1
    step_outputs: list[str] = field(default_factory=list)
    """The traced step's outputs by position (0: the loss), as tensor names of the tail's graph."""
    frontier: dict[str, FrontierSum] = field(default_factory=dict)
    """Frontier tensor (by name) -> the graph output with its per-replica sums."""
    shared: dict[str, str] = field(default_factory=dict)
    """Batch-independent tensor (by name) -> the graph output computing it whole."""
    tail: list[Op] = field(default_factory=list)
    """The ops from the frontier to the logged tensors, in order, with one replica's shapes."""
    metric_calls: list[MetricCall] = field(default_factory=list)
    """The torchmetrics calls the step makes, replayed after it with each replica's values (``capture.metrics``)."""
    per_row: dict[str, tuple[int, torch.dtype]] = field(default_factory=dict)
    """A metric's argument with one row per sample (by name) -> its rows' dim and dtype: a graph output, whole."""

    @property
    def outputs(self) -> list[str]:
        """The graph outputs after the loss that the runtime sums over ranks for this."""
        names = [sums.output for sums in self.frontier.values()] + list(self.shared.values()) + list(self.per_row)
        return list(dict.fromkeys(names))

    def per_replica(self, outputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every tail tensor by name, with a leading dim of one value per replica (shared tensors: whole).

        Args:
            outputs: The whole value of every name in ``self.outputs`` (summed over the ranks).
        """
        values: dict[str, torch.Tensor] = {}
        for name, sums in self.frontier.items():
            values[name] = outputs[sums.output].detach().reshape(self.replicas, *sums.shape).to(sums.dtype)
        shared = {name: outputs[output].detach() for name, output in self.shared.items()}
        for op in self.tail:
            values[op.outputs[0].name] = _run_per_replica(op, values, shared, self.replicas)
        for name, (dim, dtype) in self.per_row.items():  # each replica's rows, a block of the whole batch's
            values[name] = torch.stack(outputs[name].detach().to(dtype).chunk(self.replicas, dim))
        return {**shared, **values}

    def logs(self, outputs: dict[str, torch.Tensor], replica: int, module: torch.nn.Module | None = None) -> list[tuple[str, Any, dict[str, Any]]]:
        """``(name, value, options)`` of every log call, with replica ``replica``'s values, in call order; first
        the step's torchmetrics calls are made on ``module``'s metrics with those values (``capture.metrics``)."""
        values = self.per_replica(outputs) if self.outputs else {}

        def value_of(name: str) -> torch.Tensor:
            return values[name][replica] if name not in self.shared else values[name]

        def argument(kind: str, value: Any) -> Any:
            return value_of(self.step_outputs[value]) if kind == "output" else value

        results = []
        for call in self.metric_calls:
            assert module is not None, "a step with torchmetrics calls needs the module to replay them on"
            method = getattr(module.get_submodule(call.path), call.method)
            results.append(method(*(argument(*a) for a in call.arguments), **{key: argument(*a) for key, a in call.keywords}))
        logged = []
        for call in self.calls:
            if call.metric is not None:
                logged.append((call.name, module.get_submodule(call.metric), call.options))
            elif call.metric_call is not None:
                logged.append((call.name, results[call.metric_call], call.options))
            elif call.output is None:
                logged.append((call.name, call.constant, call.options))
            else:
                logged.append((call.name, value_of(self.step_outputs[call.output]), call.options))
        return logged


@dataclass
class KeptTargets:
    """The losses a step averages over the targets they keep (a cross-entropy's targets that are not its
    ``ignore_index``, which capture writes as ``sum / count(target != ignore_index)``), and how to count
    each data-parallel replica's kept targets in a whole batch.

    The plan takes such a mean over the whole global batch, as one device does; ddp averages each
    replica's own mean. They agree where every replica keeps as many targets.
    """

    replicas: int
    masks: dict[str, str] = field(default_factory=dict)
    """Loss name -> its mask of kept targets (a tensor name)."""
    rows_dim: dict[str, int] = field(default_factory=dict)
    """Mask -> its dim that holds the batch's rows, replica blocks in order (a mask absent: cannot be told apart)."""
    ops: list[Op] = field(default_factory=list)
    """The ops from the batch inputs to the masks, in order."""

    def per_replica(self, inputs: dict[str, torch.Tensor]) -> dict[str, list[int] | None]:
        """Per loss, each replica's count of kept targets in the whole batch ``inputs`` (by graph input name);
        None for a loss whose mask cannot be split by replica."""
        values = dict(inputs)
        for op in self.ops:
            values.update(zip((output.name for output in op.outputs), call_op(op, lambda _, piece: values[piece.name])))
        counts: dict[str, list[int] | None] = {}
        for loss, mask in self.masks.items():
            dim = self.rows_dim.get(mask)
            counts[loss] = None if dim is None else [int(block.sum()) for block in values[mask].chunk(self.replicas, dim)]
        return counts


def kept_targets(graph: Graph, replicas: int) -> KeptTargets:
    """The losses of ``graph`` (a traced step over ``replicas`` replicas' rows) that average over their kept targets."""
    producer = {output.name: op for op in graph.ops for output in op.outputs}
    masks = {}
    for op in graph.ops:
        if op.target == "aten.sum.default" and op.name.endswith("_count"):
            feeds = [producer.get(piece.name) for piece in op.tensor_inputs]
            masks.update({op.name.removesuffix("_count"): feed.outputs[0].name for feed in feeds
                          if feed is not None and feed.target == "aten.ne.Scalar" and feed.name.endswith("_kept")})
    if not masks:
        return KeptTargets(replicas)
    needed = needed_ops(graph, list(masks.values()))
    ops = [op for op in graph.ops if op.name in needed]
    batch = {tensor.name for tensor in graph.user_inputs} | {output.name for op in ops for output in op.outputs}
    if any(piece.name not in batch for op in ops for piece in op.tensor_inputs):  # computed from more than the batch
        return KeptTargets(replicas, masks)
    rows = batch_dims(graph, replicas)
    return KeptTargets(replicas, masks, {mask: rows[mask] for mask in masks.values() if mask in rows}, ops)


def plan_logged_values(
    graph: Graph, calls: list[LogCall], replicas: int, replica_graph: Graph | None = None, metric_calls: list[MetricCall] | None = None,
) -> LoggedValues:
    """Make ``graph`` (a traced step: outputs the loss, then the logged tensors) compute its logged
    values' per-replica sums: adds the frontier's per-row reductions and products, and leaves as
    outputs the loss, then the sums and the shared tensors (``LoggedValues.outputs``).

    Args:
        graph: The step traced on the whole batch (``replicas`` replicas' rows); edited in place.
        calls: The step's log calls (``capture.trace_step``).
        replicas: Data-parallel replicas the batch holds.
        replica_graph: The same step traced on one replica's rows (needed when ``replicas > 1``).
        metric_calls: The step's torchmetrics calls: an argument with one row per sample stays an output
            whole (each replica takes its rows); any other is computed per replica as a logged value is.

    Raises:
        LoggedValueError: a logged value reduces over the batch with an op that has no per-replica
            form (e.g. ``max``), or computes after that with an op other than an elementwise one.
    """
    metric_calls = list(metric_calls or [])
    step_outputs = list(graph.outputs)
    rows = batch_dims(graph, replicas) if metric_calls else {}
    metric_arguments = list(dict.fromkeys(
        step_outputs[value] for call in metric_calls for kind, value in (*call.arguments, *(a for _, a in call.keywords)) if kind == "output"
    ))
    per_row = {name: (rows[name], getattr(torch, graph.tensors[name].dtype)) for name in metric_arguments if name in rows}
    logged = list(dict.fromkeys([
        *(step_outputs[call.output] for call in calls if call.output is not None), *(name for name in metric_arguments if name not in per_row),
    ]))
    if not logged:
        graph.outputs = [step_outputs[0], *per_row]
        return LoggedValues(calls, replicas, step_outputs, metric_calls=metric_calls, per_row=per_row)
    tail_graph = replica_graph if replicas > 1 else graph
    if tail_graph is None:
        raise ValueError("plan_logged_values: a step with several replicas needs the step traced on one replica's batch")
    keys = _keys_by_tensor(calls, step_outputs)
    for call in metric_calls:
        keys.update({step_outputs[value]: f"{call.path}.{call.method} argument" for kind, value in call.arguments if kind == "output"})
    before = needed_ops(graph, step_outputs)
    rows = rows or batch_dims(graph, replicas)
    frontier_ops, tail_names, shared_names = _split(graph, logged, rows, keys)
    tail = _tail_ops(tail_graph, tail_names, frontier_ops, shared_names, keys)
    frontier = {name: _frontier_sums(graph, op, rows, replicas, keys) for name, op in frontier_ops.items()}
    shared = {name: _output_of(graph, name) for name in shared_names}
    result = LoggedValues(calls, replicas, step_outputs, frontier, shared, tail, metric_calls, per_row)
    graph.outputs = [step_outputs[0]] + [name for name in result.outputs if name != step_outputs[0]]
    _remove_unneeded(graph, before - needed_ops(graph, graph.outputs))
    return result


def _keys_by_tensor(calls: list[LogCall], step_outputs: list[str]) -> dict[str, str]:
    keys: dict[str, str] = {}
    for call in calls:
        if call.output is not None:
            keys.setdefault(step_outputs[call.output], call.name)
    return keys


def _split(graph: Graph, logged: list[str], rows: dict[str, int], keys: dict[str, str]) -> tuple[dict[str, Op], set[str], list[str]]:
    """Walk back from the logged tensors: the frontier ops (by output name), the tail op names, the shared tensors."""
    producers = {output.name: op for op in graph.ops for output in op.outputs}
    batch = _batch_dependent(graph)
    frontier: dict[str, Op] = {}
    tail: set[str] = set()
    shared: list[str] = []
    key_of = dict(keys)
    stack = list(logged)
    seen: set[str] = set()
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        key = key_of[name]
        if name in rows:
            raise LoggedValueError(
                f"training_step logs {key!r}, a tensor with one value per sample ({graph.tensors[name].shape}); log a "
                "reduction of it (e.g. .mean())"
            )
        if name not in batch:
            shared.append(name)
            continue
        op = producers[name]
        if any(piece.name in rows or (piece.name in batch and piece.tensor.numel > 1) for piece in op.tensor_inputs):
            frontier[name] = op  # it reduces per-sample values (also where a batch of one row hides the batch dim)
            continue
        tail.add(op.name)
        for piece in op.tensor_inputs:
            key_of.setdefault(piece.name, key)
            stack.append(piece.name)
    keys.update(key_of)
    return frontier, tail, sorted(shared, key=list(graph.tensors).index)


def _batch_dependent(graph: Graph) -> set[str]:
    """Tensors whose value depends on the batch (the user inputs and whatever is computed from them)."""
    dependent = {tensor.name for tensor in graph.user_inputs}
    for op in graph.ops:
        if any(piece.name in dependent for piece in op.tensor_inputs):
            dependent.update(output.name for output in op.outputs)
    return dependent


def _tail_ops(tail_graph: Graph, names: set[str], frontier: dict[str, Op], shared: list[str], keys: dict[str, str]) -> list[Op]:
    """The tail's ops from the one-replica trace, in order; each must be elementwise or a reshape."""
    ops = {op.name: op for op in tail_graph.ops}
    for name, op in frontier.items():
        twin = ops.get(op.name)
        if twin is None or twin.target != op.target or name not in tail_graph.tensors:
            raise LoggedValueError(
                f"training_step computes {keys[name]!r} differently for one replica's batch than for the whole batch "
                f"(op {op.name!r}); its code must not depend on the batch size"
            )
    tail = []
    for op in tail_graph.ops:
        if op.name not in names:
            continue
        pointwise = torch.Tag.pointwise in resolve_target(op.target).tags
        if not (pointwise or op.target in _SHAPE_OPS or op.target in _ANY_SHAPE_OPS) or len(op.outputs) != 1:
            raise LoggedValueError(
                f"training_step logs {keys.get(op.outputs[0].name, '?')!r} computed with op {op.name!r} ({op.target}) after "
                "reducing over the batch; NnScalerStrategy computes logged values per replica with elementwise ops there "
                "(add, mul, div, exp, log, casts). Log the parts separately, or log the value from validation_step"
            )
        tail.append(op)
    missing = names - {op.name for op in tail}
    if missing:
        raise LoggedValueError(f"training_step computes logged values differently for one replica's batch (ops {sorted(missing)})")
    for name in shared:
        if name not in tail_graph.tensors:
            raise LoggedValueError(f"training_step computes logged values differently for one replica's batch (tensor {name!r})")
    return tail


def _frontier_sums(graph: Graph, op: Op, rows: dict[str, int], replicas: int, keys: dict[str, str]) -> FrontierSum:
    """Add the per-replica sums of frontier ``op`` to ``graph``; returns the output that holds them."""
    output = op.outputs[0].tensor
    key = keys[output.name]
    if output.numel != 1 or len(op.outputs) != 1:
        raise LoggedValueError(
            f"training_step logs {key!r}, which reduces over the batch with op {op.name!r} ({op.target}) to shape "
            f"{output.shape}; log a value that reduces the whole batch to one number"
        )
    dtype = getattr(torch, output.dtype)
    if replicas == 1:
        return FrontierSum(output.name, output.shape, dtype)
    per_row, batch_dim, replacement = _per_row(graph, op, rows, key)
    names = _Names(graph)
    new_ops: list[Op] = []
    if per_row.tensor.rank > 1:
        others = [dim for dim in range(per_row.tensor.rank) if dim != batch_dim]
        summed = names.tensor("rows_sum", (per_row.shape[batch_dim],), per_row.tensor.dtype)
        new_ops.append(_op(names.op("rows_sum"), "aten.sum.dim_IntList", (per_row, others, False), summed))
        per_row = summed
    count = per_row.shape[0]
    column64 = names.tensor("rows_float64", (count,), "float64")
    new_ops.append(_op(names.op("rows_float64"), "aten._to_copy.default", (per_row,), column64, (("dtype", torch.float64),)))
    column = names.tensor("rows_column", (count, 1), "float64")
    new_ops.append(_op(names.op("rows_column"), "aten.unsqueeze.default", (column64, 1), column))
    indicator = _replica_indicator(graph, names, replicas, count)
    sums = names.tensor(f"{output.name}_per_replica", (replicas, 1), "float64")
    new_ops.append(_op(names.op(f"{output.name}_per_replica"), "aten.mm.default", (indicator, column), sums))
    graph.replace_op(op, replacement + new_ops)
    return FrontierSum(sums.name, output.shape, dtype)


def _per_row(graph: Graph, op: Op, rows: dict[str, int], key: str) -> tuple[VTensor, int, list[Op]]:
    """The rows the frontier op reduces (one value per sample along the returned dim) and what replaces the op."""
    if op.target in _SUMS:
        source = op.tensor_inputs[0]
        return source, _batch_dim(source, rows, op, key), [op]
    position = _LOSS_REDUCTION_POSITION.get(op.target)
    reduction = None if position is None else _argument(op, position[0])
    if position is None or reduction != 2:
        raise LoggedValueError(
            f"training_step logs {key!r}, which reduces over the batch with op {op.name!r} ({op.target}); NnScalerStrategy "
            "computes logged values per data-parallel replica and can split only sums, means and losses over the batch there. "
            "Log it from validation_step, or compute it from sums and means"
        )
    target = op.tensor_inputs[position[1]]
    shape = target.shape if op.target not in POINTWISE_LOSSES else tuple(torch.broadcast_shapes(*(piece.shape for piece in op.tensor_inputs)))
    names = _Names(graph)
    unreduced = names.tensor(f"{op.name}_rows", shape, op.outputs[0].tensor.dtype)
    arguments, kwargs = list(op.args), dict(op.kwargs)
    if len(arguments) > position[0]:
        arguments[position[0]] = 0
    else:
        kwargs["reduction"] = 0
    per_row_op = _op(names.op(f"{op.name}_rows"), op.target, tuple(arguments), unreduced, tuple(kwargs.items()), no_grad=op.no_grad)
    total = replace(op, target="aten.sum.default", args=(unreduced,), kwargs=())
    total = replace(total, annotation=annotate_op(total))
    return unreduced, _batch_dim(target, rows, op, key), [per_row_op, total]


def _batch_dim(piece: VTensor, rows: dict[str, int], op: Op, key: str) -> int:
    """The dim of ``piece`` that holds the batch's rows (replica blocks in order)."""
    if piece.name not in rows:
        raise LoggedValueError(
            f"training_step logs {key!r}, reduced over the batch by op {op.name!r} ({op.target}) from %{piece.name}, whose "
            "rows cannot be told apart by replica (the batch split does not reach it); log it from validation_step"
        )
    return rows[piece.name]


def _argument(op: Op, position: int) -> Any:
    return op.args[position] if len(op.args) > position else op.kwargs_dict.get("reduction", 1)



def _replica_indicator(graph: Graph, names: _Names, replicas: int, count: int) -> VTensor:
    """A constant ``[replicas, count]`` matrix: row r is 1 on replica r's block of rows."""
    indicator = names.tensor("replica_indicator", (replicas, count), "float64", role="constant")
    value = torch.zeros(replicas, count, dtype=torch.float64)
    block = count // replicas
    for replica in range(replicas):
        value[replica, replica * block : (replica + 1) * block] = 1.0
    graph.inputs.append(indicator.name)
    graph.constant_values[indicator.name] = value
    return indicator


def _output_of(graph: Graph, name: str) -> str:
    """``name``, or a copy of it when it is a graph input (a graph output is an op's)."""
    if name not in graph.inputs:
        return name
    names = _Names(graph)
    tensor = graph.tensors[name]
    copy = names.tensor(f"{name}_logged", tensor.shape, tensor.dtype)
    graph.add_op(_op(names.op(f"{name}_logged"), "aten.clone.default", (tensor.full(),), copy))
    return copy.name


def _op(name: str, target: str, args: tuple, output: VTensor, kwargs: tuple = (), *, no_grad: bool = True) -> Op:
    op = Op(name=name, target=target, args=args, kwargs=kwargs, outputs=(output,), no_grad=no_grad)
    return replace(op, annotation=annotate_op(op))


class _Names:
    """Fresh op and tensor names in ``graph``; ``tensor`` also adds the PTensor."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph

    def op(self, base: str) -> str:
        taken = {op.name for op in self.graph.ops}
        return _fresh(base, taken)

    def tensor(self, base: str, shape: tuple[int, ...], dtype: str, role: str = "activation") -> VTensor:
        name = _fresh(base, set(self.graph.tensors) | {op.name for op in self.graph.ops})
        tensor = PTensor(name, tuple(shape), dtype, role)
        self.graph.tensors[name] = tensor
        return tensor.full()


def _fresh(base: str, taken: set[str]) -> str:
    if base not in taken:
        return base
    index = 1
    while f"{base}_{index}" in taken:
        index += 1
    return f"{base}_{index}"


def _remove_unneeded(graph: Graph, unneeded: set[str]) -> None:
    if unneeded:
        graph.ops = [op for op in graph.ops if op.name not in unneeded]


def _run_per_replica(op: Op, values: dict[str, torch.Tensor], shared: dict[str, torch.Tensor], replicas: int) -> torch.Tensor:
    """Run tail ``op`` on values with a leading replica dim (shared values broadcast over the replicas)."""
    shape = op.outputs[0].shape
    if op.target in _SHAPE_OPS:
        (source,) = [values[piece.name] for piece in op.tensor_inputs]
        return source.reshape(replicas, *shape)
    rank = len(shape)

    def aligned(_: int, piece: VTensor) -> torch.Tensor:
        if piece.name in values:
            value = values[piece.name]
            return value.reshape(replicas, *([1] * (rank - value.dim() + 1)), *value.shape[1:])
        value = shared[piece.name]
        return value.reshape(1, *([1] * (rank - value.dim())), *value.shape)

    args, kwargs = op.map_tensor_inputs(aligned)
    result = resolve_target(op.target)(*args, **dict(kwargs))
    if tuple(result.shape) != (replicas, *shape):
        result = result.reshape(replicas, *shape) if result.numel() == replicas * math.prod(shape) else result
    return result
