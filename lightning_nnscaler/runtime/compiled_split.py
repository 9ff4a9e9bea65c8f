"""Zero-bubble under ``torch.compile``: each compiled graph's backward as two compiled halves, I and W.

A compiled graph is one autograd node (AOTAutograd's ``CompiledFunctionBackward``) whose backward is
one compiled function of the graph's saved tensors and output gradients, returning one gradient per
graph input. Here that backward graph (the partitioned joint graph, FX) is cut in two before it is
compiled:

- the *input half* (I): the nodes the gradients of the graph's non-parameter inputs need (everything
  on the way to the boundary inputs, the activations);
- the *weight half* (W): the remaining nodes that the parameters' gradients need. Its inputs are the
  saved tensors it reads and the intermediates of I it reads (the *handover*, e.g. the gradient of a
  linear's output, which its weight gradient multiplies), which I returns besides its gradients.

Each half is compiled by the segment's backend (inductor's ``compile_fx_inner``, or AOT-eager's plain
graph). The node's backward runs I and then W, unless its I was *armed* (``arm``, by
``runtime.split_backward`` during a zero-bubble ``B``): then it runs I alone, returns no parameter
gradient, and leaves W in a ``SplitSlot`` that the segment's ``W`` runs later. W's gradients then
reach the parameters' accumulators by ``torch.autograd.backward`` from the node's edges, so that the
parameters' post-accumulate-grad hooks fire as in a plain backward. Every backward op thus runs once
and W never repeats an op of I; an op that yields both kinds of gradient at once (a layer norm's
backward) runs in I, which hands its weight gradients over. The handover and the saved tensors W
reads live until W. Which inputs are parameters (``torch.nn.Parameter``) is read from Dynamo's example
inputs; their order is the backward's outputs' and the node's ``next_functions``'.

A graph whose backward does not have one gradient per input of the Dynamo graph (an AOTAutograd
wrapper changed its inputs: duplicated or aliased inputs) is not split: its backward stays one
compiled function, run whole in both I and W (as ``runtime.compiled`` describes). Backends other than
``inductor`` and ``aot_eager`` keep that behaviour too (``split_backend`` returns None for them).
"""

from __future__ import annotations

import functools
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import Node
from torch.fx import Graph, GraphModule
from torch.fx import Node as FxNode
from torch.utils.hooks import RemovableHandle

Part = Callable[..., Any]
PartCompiler = Callable[[GraphModule, list[Any], Mapping[str, Any]], Part]


@dataclass
class SplitSlot:
    """What an armed compiled backward left for W: its gradients (weight positions still None) and its weight half."""

    gradients: list[torch.Tensor | None] | None = None
    weights: Callable[[], list[torch.Tensor | None]] | None = None
    weight_positions: tuple[int, ...] = ()

    @property
    def filled(self) -> bool:
        """Whether the node's backward ran split (I alone)."""
        return self.gradients is not None


_armed = threading.local()


def arm(node: Node, slot: SplitSlot, keep: Sequence[int]) -> list[RemovableHandle]:
    """Make ``node``'s next backward, if it is a split compiled one, run I alone and leave W in ``slot``, with I's
    gradients at positions ``keep`` (those W passes on; the others are dropped once the node has run).

    The node's pre-hook arms the slot on the running thread (autograd runs a node's pre-hooks and its
    backward on one thread) and its post-hook disarms it, so no other node's backward takes it.
    """

    def set_slot(_: Any) -> None:
        _armed.slot = slot

    def clear_slot(*_: Any) -> None:
        _armed.slot = None
        if slot.gradients is not None:
            slot.gradients = [gradient if position in keep else None for position, gradient in enumerate(slot.gradients)]

    return [node.register_prehook(set_slot), node.register_hook(clear_slot)]


def is_compiled_node(node: Node) -> bool:
    """Whether ``node`` is a compiled graph's backward (AOTAutograd's)."""
    return node.name() == "CompiledFunctionBackward"


def _take_armed() -> SplitSlot | None:
    slot = getattr(_armed, "slot", None)
    _armed.slot = None
    return slot


def _call(part: Part | None, args: list[Any]) -> list[Any]:
    """Run a compiled half (boxed or not) on ``args`` as autograd runs a backward (no grad, autocast off: the graph
    holds its casts); no half: no outputs."""
    if part is None:
        return []
    with torch.no_grad(), torch._C._DisableAutocast():
        return list(part(args) if getattr(part, "_boxed_call", False) else part(*args))


@dataclass
class BackwardParts:
    """A backward graph cut in two (``split_graph``), before compilation."""

    graph: GraphModule
    """The whole backward graph."""
    input_graph: GraphModule | None
    weight_graph: GraphModule | None
    input_args: list[int]
    """Positions in the backward's arguments of I's arguments."""
    weight_args: list[int]
    """Positions in the backward's arguments of W's arguments (before the handover)."""
    input_positions: list[int]
    """Which gradients (positions among the backward's outputs) I returns, in order."""
    weight_positions: tuple[int, ...]
    """Which gradients W returns, in order."""
    outputs: int
    """How many gradients the backward returns."""


class SplitBackward:
    """A compiled graph's backward as its two compiled halves (AOTAutograd calls it boxed: one list of arguments)."""

    def __init__(self, parts: BackwardParts, input_part: Part | None, weight_part: Part | None) -> None:
        self.parts, self.input_part, self.weight_part = parts, input_part, weight_part
        self._boxed_call = True  # on the instance: Dynamo's wrapper of a backward copies its __dict__
        self.runs: Counter[str] = Counter()
        """How many times each half ran (``input``, ``weight``), and how many times W was left for later (``deferred``)."""

    def __call__(self, args: list[Any]) -> list[torch.Tensor | None]:
        parts = self.parts
        input_args = [args[index] for index in parts.input_args]
        weight_args = [args[index] for index in parts.weight_args]
        args.clear()
        outputs = self._run("input", self.input_part, input_args)
        gradients: list[torch.Tensor | None] = [None] * parts.outputs
        for position, gradient in zip(parts.input_positions, outputs):
            gradients[position] = gradient
        handover = outputs[len(parts.input_positions):]
        weights = functools.partial(self._run, "weight", self.weight_part, weight_args + handover)
        slot = _take_armed()
        if slot is None:
            for position, gradient in zip(parts.weight_positions, weights()):
                gradients[position] = gradient
            return gradients
        self.runs["deferred"] += 1
        slot.gradients, slot.weights, slot.weight_positions = list(gradients), weights, parts.weight_positions
        return gradients

    def _run(self, name: str, part: Part | None, args: list[Any]) -> list[Any]:
        if part is not None:
            self.runs[name] += 1
        return _call(part, list(args))


def _ancestors(roots: Iterable[Any]) -> set[FxNode]:
    """The FX nodes ``roots`` are computed from, themselves included."""
    seen: set[FxNode] = set()
    stack = [root for root in roots if isinstance(root, FxNode)]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


def _subgraph(module: GraphModule, inputs: Sequence[FxNode], compute: set[FxNode], outputs: Sequence[Any]) -> GraphModule:
    """A graph of ``module``'s nodes ``compute`` (in their order) with placeholders for ``inputs``, returning ``outputs``."""
    graph = Graph()
    env: dict[FxNode, FxNode] = {}
    for node in inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in module.graph.nodes:
        if node in compute and node.op not in ("placeholder", "output"):
            env[node] = graph.node_copy(node, lambda used: env[used])
    graph.output(tuple(env[value] if isinstance(value, FxNode) else value for value in outputs))
    return GraphModule(module, graph)


def split_graph(module: GraphModule, weight_positions: Sequence[int]) -> BackwardParts:
    """Cut the backward graph ``module`` into I (the gradients not in ``weight_positions``) and W (the others).

    I holds every node its gradients need; W the nodes only the weight gradients need, reading the
    saved tensors and output gradients it uses directly and I's nodes it uses as the handover.
    """
    placeholders = list(module.graph.find_nodes(op="placeholder"))
    (returned,) = module.graph.find_nodes(op="output")[0].args
    returned = list(returned)
    weight_positions = tuple(weight_positions)
    input_positions = [position for position in range(len(returned)) if position not in weight_positions]
    needed_by_input = _ancestors(returned[position] for position in input_positions)
    weight_outputs = [returned[position] for position in weight_positions]
    weight_only = _ancestors(weight_outputs) - needed_by_input
    read_by_weight = {used for node in weight_only for used in node.all_input_nodes} | {
        value for value in weight_outputs if isinstance(value, FxNode)}
    handover = [node for node in module.graph.nodes if node in read_by_weight and node in needed_by_input and node.op != "placeholder"]
    weight_inputs = [node for node in placeholders if node in read_by_weight]
    input_inputs = [node for node in placeholders if node in needed_by_input]
    input_outputs = [returned[position] for position in input_positions] + handover
    return BackwardParts(
        graph=module,
        input_graph=_subgraph(module, input_inputs, needed_by_input, input_outputs) if any(
            isinstance(value, FxNode) for value in input_outputs) else None,
        weight_graph=_subgraph(module, weight_inputs + handover, weight_only, weight_outputs) if any(
            isinstance(value, FxNode) for value in weight_outputs) else None,
        input_args=[placeholders.index(node) for node in input_inputs],
        weight_args=[placeholders.index(node) for node in weight_inputs],
        input_positions=input_positions, weight_positions=weight_positions, outputs=len(returned),
    )


def splitting_compiler(
    compile_part: PartCompiler, whole: Callable[[GraphModule, list[Any]], Part], parameters: Sequence[bool],
    recorded: list[SplitBackward],
) -> Callable[..., Part]:
    """A backward compiler that cuts the graph (``split_graph``: the gradients of ``parameters``' inputs are W's) and
    compiles each half with ``compile_part(graph, example inputs, options)``; a backward whose outputs do not match
    the graph's inputs goes to ``whole`` instead. Each ``SplitBackward`` made is appended to ``recorded``."""

    def compile_backward(module: GraphModule, example_inputs: list[Any], **options: Any) -> Part:
        (returned,) = module.graph.find_nodes(op="output")[0].args
        if len(returned) != len(parameters):
            return whole(module, example_inputs, **options)
        parts = split_graph(module, [position for position, parameter in enumerate(parameters) if parameter])
        split = SplitBackward(
            parts,
            None if parts.input_graph is None else compile_part(parts.input_graph, _examples(parts.input_graph), options),
            None if parts.weight_graph is None else compile_part(parts.weight_graph, _examples(parts.weight_graph), options),
        )
        recorded.append(split)
        return split

    return compile_backward


def _examples(module: GraphModule) -> list[Any]:
    """The example values (fake tensors) of ``module``'s arguments, as AOTAutograd traced them."""
    return [node.meta.get("val") for node in module.graph.find_nodes(op="placeholder")]


@dataclass
class SplitBackend:
    """A Dynamo backend (``torch.compile(backend=...)``) whose graphs' backwards are split (``SplitBackward``).

    ``name``: ``"inductor"`` (with ``config``, the inductor options of the call's ``mode`` and ``options``) or
    ``"aot_eager"``.
    """

    name: str
    config: dict[str, Any] = field(default_factory=dict)
    splits: list[SplitBackward] = field(default_factory=list)
    """Every split backward compiled so far (one per compiled graph that ran a backward)."""

    def __call__(self, module: GraphModule, example_inputs: list[Any]) -> Part:
        """Compile Dynamo's graph ``module``: forward as the backend does, backward split. Never from AOTAutograd's
        cache, which could hold the graph compiled with its backward whole (its key knows no backward compiler)."""
        import torch._functorch.config as functorch_config

        parameters = [isinstance(value, torch.nn.Parameter) for value in example_inputs]
        with functorch_config.patch(enable_autograd_cache=False, enable_remote_autograd_cache=False):
            if self.name == "inductor":
                return self._inductor(module, example_inputs, parameters)
            return self._aot_eager(module, example_inputs, parameters)

    def _aot_eager(self, module: GraphModule, example_inputs: list[Any], parameters: list[bool]) -> Part:
        from torch._dynamo.backends.debugging import aot_eager

        def nop(graph: GraphModule, *_: Any, **__: Any) -> Part:
            return graph

        backward = splitting_compiler(nop, nop, parameters, self.splits)
        return aot_eager(module, example_inputs, bw_compiler=lambda graph, inputs: backward(graph, inputs))

    def _inductor(self, module: GraphModule, example_inputs: list[Any], parameters: list[bool]) -> Part:
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        def compile_part(graph: GraphModule, inputs: list[Any], options: Mapping[str, Any]) -> Part:
            return compile_fx_inner(graph, inputs, **{**options, "static_input_idxs": ()})

        backward = splitting_compiler(compile_part, compile_fx_inner, parameters, self.splits)

        def inner(graph: GraphModule, inputs: list[Any], **options: Any) -> Part:
            if options.get("is_backward"):
                return backward(graph, inputs, **options)
            return compile_fx_inner(graph, inputs, **options)

        return compile_fx(module, example_inputs, inner_compile=inner, config_patches=self.config)


def split_backend(options: Mapping[str, Any]) -> tuple[SplitBackend, dict[str, Any]] | None:
    """The backend that splits backwards for ``torch.compile`` keyword ``options``, and the keywords to call
    ``torch.compile`` with besides it; None when the options' backend is another (its backwards stay whole)."""
    name = options.get("backend", "inductor")
    if name not in ("inductor", "aot_eager"):
        return None
    rest = {key: value for key, value in options.items() if key not in ("backend", "mode", "options")}
    config: dict[str, Any] = {}
    if name == "inductor":
        config = dict(torch._TorchCompileInductorWrapper(options.get("mode"), options.get("options"), options.get("dynamic")).config)
    elif options.get("mode") or options.get("options"):
        return None
    return SplitBackend(name, config), rest
