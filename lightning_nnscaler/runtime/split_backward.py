"""A segment's backward in two halves that together run each backward op once: I (input gradients) and W (weight gradients).

Zero-bubble schedules run ``I(s, m)`` on the critical path and ``W(s, m)`` later. The split is the one
``torch.distributed.pipelining`` makes (``stage_backward_input`` / ``stage_backward_weight``):

- The segment's autograd graph, walked once from the root, falls into *input-path* nodes (those from
  which a boundary input's accumulator is reachable) and the others. A *junction* is an input-path
  node with an edge to a non-input-path node that leads to a parameter: a linear's ``AddmmBackward``
  (edges to its input and to its weight), a layer norm's node, an inline collective whose token chain
  reaches a parameter's path.
- ``input_gradients`` differentiates the root with respect to the boundary inputs only
  (``torch.autograd.grad``, graph retained). Autograd then runs the input-path nodes alone, each
  computing only the outputs on the way to the inputs (a junction computes its input half; its
  weight half is skipped). A pre-hook on every junction keeps the gradient it received.
- ``WeightPass.accumulate`` (W) starts from those kept gradients, never from the root: per group of
  junctions that share parameters, one ``torch.autograd.backward`` from the junctions' gradient
  edges with ``inputs=`` the group's parameters. Each junction now computes only its weight half and
  the weight-only nodes below it run; the parameters' gradients accumulate into ``.grad`` through
  their accumulators, so post-accumulate-grad hooks (the reducer's buckets) see each parameter of
  the segment exactly once per W (the groups partition the parameters).
- A group of several junctions where one reaches another along the input path (a weight used twice
  in a chain) would make W carry a gradient into the later junction besides the kept one: a pre-hook
  pins each junction of such a group to its kept gradient (torch's clamp), and that input-path link
  is the only input-gradient work W repeats. Plain layer stacks have none.

A segment without boundary inputs that need gradients (the first stage) has no I work: W is the
whole backward, one ``backward`` from the root.

A compiled graph (``torch.compile``: one autograd node for the whole graph) that is the only junction
of its group is split inside (``runtime.compiled_split``): I arms it, so that its backward runs only
its compiled input half and leaves its weight half in the group; W runs that half and one ``backward``
from the node's edges that leave the input path (seeded with the weight half's gradients) into the
group's parameters. A compiled junction in a group of several keeps the kept-gradient route above,
its backward run whole in I and again in W.

Costs that remain: I retains the segment's whole graph until its W (as before the split); the walk
that finds the junctions runs in Python once per I; and a checkpointed region (``recompute_stages``)
under a segment with input gradients is recomputed by I and once more by each W group that unpacks
its saved tensors (non-reentrant checkpointing recomputes per autograd call).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node

from lightning_nnscaler.runtime.compiled_split import SplitSlot, arm, is_compiled_node


@dataclass
class _Group:
    """Junctions whose weight-only paths share parameters, and those parameters."""

    parameters: list[torch.Tensor]
    junctions: list[Node]
    kept: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)
    edges: dict[Node, dict[int, tuple[Node, int]]] = field(default_factory=dict)
    """Per junction, its inputs that leave the input path toward parameters: ``next_functions`` position -> edge, read
    when the group is made (torch 2.11 refuses reading a compiled node's ``next_functions`` once its backward ran)."""
    split: SplitSlot | None = None
    """A group of one compiled junction: what its split backward leaves for W (``runtime.compiled_split``)."""


@dataclass
class WeightPass:
    """What I left for W: the groups' junctions with their kept gradients, or the root when I had nothing to do."""

    groups: list[_Group]
    root: torch.Tensor | None = None
    parameters: list[torch.Tensor] = field(default_factory=list)

    def accumulate(self) -> None:
        """W: accumulate the segment's parameter gradients into ``.grad`` (each parameter once)."""
        if self.root is not None:
            root, self.root = self.root, None
            if self.parameters:
                torch.autograd.backward(root, inputs=self.parameters)
            return
        for group in self.groups:
            _accumulate_group(group)
        self.groups = []


def _accumulate_group(group: _Group) -> None:
    """One ``backward`` from the group's junction edges, seeded with their kept gradients, into its parameters."""
    if group.split is not None and group.split.filled:
        _accumulate_split(group, group.split)
        return
    edges, seeds = [], []
    for junction in group.junctions:
        for index, gradient in enumerate(group.kept.get(junction, ())):
            if gradient is not None:
                edges.append(GradientEdge(junction, index))
                seeds.append(gradient)
    if not edges:
        return
    pins = []
    if len(group.junctions) > 1:
        for junction in group.junctions:
            kept = group.kept.get(junction)
            if kept is not None:
                pins.append(junction.register_prehook(lambda _, kept=kept: kept))
    try:
        torch.autograd.backward(edges, grad_tensors=seeds, inputs=group.parameters, retain_graph=True)
    finally:
        for pin in pins:
            pin.remove()


def _accumulate_split(group: _Group, split: SplitSlot) -> None:
    """W of a compiled junction whose I ran alone: its weight half, then one ``backward`` from the junction's inputs
    that leave the input path (seeded with W's gradients, or I's for an input that is no parameter) into the
    group's parameters: their accumulators run once each, as in a plain backward."""
    (junction,) = group.junctions
    gradients = list(split.gradients or ())
    for position, gradient in zip(split.weight_positions, split.weights() if split.weights is not None else ()):
        gradients[position] = gradient
    group.split = None
    edges, seeds = [], []
    for position, (child, index) in group.edges.get(junction, {}).items():
        if gradients[position] is not None:
            edges.append(GradientEdge(child, index))
            seeds.append(gradients[position])
    if edges:
        torch.autograd.backward(edges, grad_tensors=seeds, inputs=group.parameters)


def input_gradients(
    root: torch.Tensor, leaves: list[torch.Tensor], parameters: list[torch.Tensor]
) -> tuple[tuple[torch.Tensor | None, ...], WeightPass]:
    """I: the gradients of ``root`` with respect to ``leaves`` (None where unused), and what W needs.

    Args:
        root: The segment's scalar root (its seeds and sent tensors weighted by their gradients, and its token).
        leaves: The boundary inputs that carry a gradient (leaves that require grad).
        parameters: The parameters whose gradients W accumulates (those not in this graph are ignored).
    """
    node = root.grad_fn
    if node is None or not leaves:
        return tuple(None for _ in leaves), WeightPass([], root if node is not None else None, list(parameters))
    groups = _groups(node, {id(leaf) for leaf in leaves}, {id(parameter): parameter for parameter in parameters})
    if groups is None:  # no leaf is reached: no input gradients, and W is the whole backward
        return tuple(None for _ in leaves), WeightPass([], root, list(parameters))
    handles = []
    for group in groups:
        for junction in group.junctions:
            handles.append(junction.register_prehook(_keeper(group.kept, junction)))
        if len(group.junctions) == 1 and is_compiled_node(group.junctions[0]):
            group.split = SplitSlot()
            handles += arm(group.junctions[0], group.split, list(group.edges[group.junctions[0]]))
    try:
        gradients = torch.autograd.grad(root, leaves, retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    return gradients, WeightPass(groups)


def _keeper(kept: dict[Node, tuple[torch.Tensor | None, ...]], junction: Node):
    """A pre-hook that keeps the gradients ``junction`` receives (and changes nothing)."""

    def keep(gradients: tuple[torch.Tensor | None, ...]) -> None:
        kept[junction] = tuple(gradients)

    return keep


def _classify(
    root: Node, leaf_ids: set[int], parameter_ids: set[int]
) -> tuple[list[Node], dict[Node, tuple[Node, ...]], set[Node], dict[Node, frozenset[int]]]:
    """One walk of ``root``'s graph: its nodes (children before parents), each node's children, the
    input-path nodes, and for every other node the ids of the parameters it leads to."""
    order: list[Node] = []
    children: dict[Node, tuple[Node, ...]] = {}
    on_input_path: set[Node] = set()
    reached: dict[Node, frozenset[int]] = {}
    none: frozenset[int] = frozenset()
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        if not finished:
            if node not in children:
                kids = children[node] = tuple(child for child, _ in node.next_functions if child is not None)
                stack.append((node, True))
                stack.extend((child, False) for child in kids if child not in children)
            continue
        order.append(node)
        kids = children[node]
        if not kids:
            variable_id = id(getattr(node, "variable", None))
            if variable_id in leaf_ids:
                on_input_path.add(node)
            else:
                reached[node] = frozenset((variable_id,)) if variable_id in parameter_ids else none
        elif any(child in on_input_path for child in kids):
            on_input_path.add(node)
        else:
            reached[node] = none.union(*(reached[child] for child in kids))
    return order, children, on_input_path, reached


def _groups(root: Node, leaf_ids: set[int], parameters: dict[int, torch.Tensor]) -> list[_Group] | None:
    """The junctions of ``root``'s graph grouped by shared parameters (see the module docstring), in walk
    order; None when ``root`` reaches no leaf."""
    order, children, on_input_path, reached = _classify(root, leaf_ids, set(parameters))
    if root not in on_input_path:
        return None
    parent: dict[int, int] = {}

    def find(key: int) -> int:
        while parent.setdefault(key, key) != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    junctions: list[tuple[Node, int]] = []
    for node in order:
        if node not in on_input_path:
            continue
        found = [key for child in children[node] if child not in on_input_path for key in reached[child]]
        if found:
            for key in found[1:]:
                parent[find(key)] = find(found[0])
            junctions.append((node, found[0]))
    by_root: dict[int, _Group] = {}
    for node, key in junctions:
        group = by_root.setdefault(find(key), _Group([], []))
        group.junctions.append(node)
        group.edges[node] = {
            position: (child, index) for position, (child, index) in enumerate(node.next_functions)
            if child is not None and child not in on_input_path and reached[child]
        }
    for key in parameters:
        if key in parent:
            by_root[find(key)].parameters.append(parameters[key])
    return list(by_root.values())
