"""Plan validation: every op placed, devices in range, every device used, and no deadlock.

A plan deadlocks when its ops wait on each other in a cycle. An op waits on
- the ops whose output pieces overlap its input pieces (data dependencies),
- the ops ordered before it by ``op_order`` (``graph.order_edges``),
- the op before it on its device (a device runs its ops in ``graph.ops`` list order).
``validate_plan`` checks that the union of these edges is acyclic and, when it is not, names the
cycle and why each of its edges exists. ``stable_topological_order`` repairs a list order that
contradicts data dependencies or order edges (``op_order`` calls it after adding an edge).
"""

from __future__ import annotations

import bisect
import heapq
from collections import defaultdict

from lightning_nnscaler.ir.errors import NnScalerError
from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir.op import Op
from lightning_nnscaler.ir.tensor import IndexMask

_MAX_NAMED = 5  # ops named in one message before "and N more"
# What to change for a cycle, by the kind of its edges that is easiest to change (first listed).
_DEADLOCK_FIXES = {
    "device": "a device runs its ops in graph.ops list order, which contradicts the edges above;"
    " reorder with graph.ops = stable_topological_order(graph) (op_order does this when it adds an edge)",
    "order": "remove one of the op_order edges above; data dependencies cannot be reversed",
    "data": "the ops read each other's outputs; check the pieces that op_trans made",
}


class PlanError(NnScalerError, ValueError):
    """A plan that cannot run as it stands."""


class UnassignedOpError(PlanError):
    """Some op has no device."""


class DeviceOutOfRangeError(PlanError):
    """Some op is placed on a device outside ``0..world_size-1``."""


class IdleRankError(PlanError):
    """Some rank of ``0..world_size-1`` runs no op: the plan is for fewer ranks than it is run on."""


class UnknownOpError(PlanError):
    """An order edge names an op that is not in the graph."""


class DeadlockError(PlanError):
    """The plan would hang: its ops wait on each other in a cycle, or (simulated) its ranks' lists cannot all finish.

    Attributes:
        cycle: Op names along the cycle, first name repeated last: ``["a", "b", "a"]``; empty when the simulator
            found the ranks stuck (the message names each stuck rank's task).
    """

    def __init__(self, message: str, cycle: list[str] | None = None) -> None:
        super().__init__(message)
        self.cycle = cycle or []


def data_dependencies(graph: Graph) -> dict[str, list[str]]:
    """For each op name, the names of the ops it reads from.

    Op B reads from op A iff an input piece of B overlaps an output piece of A: same PTensor and
    intersecting index boxes (value shares do not matter: a partial sum is still a write).
    Producers are listed in the order B's inputs are read, each once; an op never depends on itself.
    """
    return {name: list(producers) for name, producers in _data_edges(graph).items()}


def find_cycle(node_names: list[str], edges: dict[str, list[str]]) -> list[str] | None:
    """One cycle of the directed graph ``edges`` (node -> successors), or ``None`` when acyclic.

    Iterative depth-first search, so deep graphs do not hit Python's recursion limit. The cycle is
    returned as ``[a, b, ..., a]`` following the edges, starting at its node that comes first in
    ``node_names``.
    """
    position = {name: index for index, name in enumerate(node_names)}
    state: dict[str, bool] = {}  # True while on the current path, False once fully explored
    for root in node_names:
        if root in state:
            continue
        path = [root]
        successors = [iter(edges.get(root, ()))]
        state[root] = True
        while path:
            for successor in successors[-1]:
                if successor not in state:
                    state[successor] = True
                    path.append(successor)
                    successors.append(iter(edges.get(successor, ())))
                    break
                if state[successor]:
                    cycle = path[path.index(successor) :]
                    start = min(range(len(cycle)), key=lambda i: position.get(cycle[i], len(position)))
                    cycle = cycle[start:] + cycle[:start]
                    return cycle + [cycle[0]]
            else:
                state[path.pop()] = False
                successors.pop()
    return None


def stable_topological_order(graph: Graph) -> list[Op]:
    """``graph.ops`` reordered to respect data dependencies and order edges, moving as little as possible.

    Kahn's algorithm that always takes the ready op that comes first in the current list (a heap
    keyed by list position), so an already valid list comes back unchanged.

    Complexity: O((V + E) log V) for V ops and E edges (order edges plus data dependencies); finding
    the data dependencies costs O(R log B) for R input pieces read and at most B pieces written per
    tensor (plus the overlaps found). ``op_orders`` adds many edges with one call of this.

    Raises:
        UnknownOpError: An order edge names an op that is not in the graph.
        DeadlockError: Data dependencies and order edges form a cycle; the message lists it.
    """
    _check_order_edges(graph)
    index = {op.name: position for position, op in enumerate(graph.ops)}
    data = _data_edges(graph)
    successors = _successors(graph, data, graph.order_edges)
    in_degree = dict.fromkeys(index, 0)
    for targets in successors.values():
        for target in targets:
            in_degree[target] += 1
    ready = [position for name, position in index.items() if in_degree[name] == 0]
    heapq.heapify(ready)
    order: list[Op] = []
    while ready:
        op = graph.ops[heapq.heappop(ready)]
        order.append(op)
        for target in successors.get(op.name, ()):
            in_degree[target] -= 1
            if in_degree[target] == 0:
                heapq.heappush(ready, index[target])
    if len(order) < len(graph.ops):
        stuck = [op.name for op in graph.ops if in_degree[op.name] > 0]
        cycle = find_cycle(stuck, successors)
        assert cycle is not None, "Kahn's algorithm stopped, so a cycle is left"
        raise _deadlock(graph, data, cycle)
    return order


def validate_plan(graph: Graph, world_size: int | None = None) -> None:
    """Check that the plan can run: placed, in range, ordered without a deadlock, no rank idle.

    Args:
        graph: The planned graph.
        world_size: Number of devices; when given, every device must be in ``0..world_size-1``
            and each of them must run at least one op.

    Raises:
        UnassignedOpError: Some op has no device.
        DeviceOutOfRangeError: Some op's device is outside ``0..world_size-1``.
        UnknownOpError: An order edge names an op that is not in the graph.
        DeadlockError: Data dependencies, order edges and the per-device list order form a cycle.
        IdleRankError: Some rank of ``0..world_size-1`` runs no op (checked last).
    """
    unassigned = [op.name for op in graph.ops if op.device is None]
    if unassigned:
        subject = f"op {unassigned[0]!r} is" if len(unassigned) == 1 else f"{_name_list(unassigned)} are"
        raise UnassignedOpError(
            f"{subject} not assigned to a device; call op_assign(graph, op, device) for every op"
            " (or every piece after op_trans)"
        )
    if world_size is not None:
        outside = [op for op in graph.ops if op.device is not None and not 0 <= op.device < world_size]
        if outside:
            placements = ", ".join(f"op {op.name!r} is on device {op.device}" for op in outside[:_MAX_NAMED])
            more = f" (and {len(outside) - _MAX_NAMED} more ops)" if len(outside) > _MAX_NAMED else ""
            raise DeviceOutOfRangeError(
                f"{placements}{more}, outside the {world_size} devices 0..{world_size - 1} of world_size {world_size};"
                f" call op_assign(graph, op, device) with a device below {world_size}, or raise world_size"
            )
    _check_order_edges(graph)
    if not graph.in_dependency_order:  # in such an order every edge, a device's list order too, points forward: no cycle
        _check_acyclic(graph)
    if world_size is not None:
        check_no_idle_rank(graph, world_size)


def _check_acyclic(graph: Graph) -> None:
    """Raise ``DeadlockError`` when data dependencies, order edges and each device's list order form a cycle."""
    names = [op.name for op in graph.ops]
    data = _data_edges(graph)
    cycle = find_cycle(names, _successors(graph, data, graph.order_edges))
    if cycle is None:  # data and order alone are satisfiable; now add each device's list order
        cycle = find_cycle(names, _successors(graph, data, graph.order_edges + _device_sequence(graph)))
    if cycle is not None:
        raise _deadlock(graph, data, cycle)


def idle_ranks(graph: Graph, world_size: int) -> list[int]:
    """The ranks of ``0..world_size-1`` that no op is assigned to (none for a graph without ops)."""
    used = {op.device for op in graph.ops}
    return [rank for rank in range(world_size) if rank not in used] if graph.ops else []


def check_no_idle_rank(graph: Graph, world_size: int) -> None:
    """Raise IdleRankError naming the ranks of ``0..world_size-1`` that run no op, and the fix."""
    idle = idle_ranks(graph, world_size)
    if idle:
        used = world_size - len(idle)
        subject = f"rank {idle[0]}" if len(idle) == 1 else f"ranks {', '.join(map(str, idle[:8]))}{' ...' if len(idle) > 8 else ''}"
        raise IdleRankError(
            f"{subject} of world_size {world_size} {'runs' if len(idle) == 1 else 'run'} no op: the plan uses only {used} of "
            f"its {world_size} ranks, and an idle rank holds a device without doing any work. Plan for world_size {used}, "
            "or place work on every rank (op_assign(graph, op, rank) for the pieces of a split, or a recipe that splits over all ranks)"
        )


def _data_edges(graph: Graph) -> dict[str, dict[str, str]]:
    """consumer op name -> {producer op name: name of the first tensor it reads from that producer}."""
    # tensor name -> index box -> ops writing it (value shares of one box share an entry)
    # A piece written exactly (same box and value part) is read from its writers alone, as
    # materialization does: microbatch k's share of a loss depends on microbatch k only.
    # Keys are plain tuples (tensor, ranges, value part, parts): hashed in C, not by the masks' dataclass hashes.
    producers: dict[str, dict[IndexMask, list[str]]] = defaultdict(lambda: defaultdict(list))
    exact: dict[tuple, list[str]] = defaultdict(list)
    for op in graph.ops:
        for piece in op.outputs:
            producers[piece.name][piece.index].append(op.name)
            exact[(piece.tensor.name, piece.index.ranges, piece.value.part, piece.value.parts)].append(op.name)
    writers = {name: _BoxIndex(boxes) for name, boxes in producers.items()}
    # Many consumers read the same piece (replicated or sibling ops): look each piece up once.
    overlapping: dict[tuple, list[str]] = {}
    edges: dict[str, dict[str, str]] = {}
    place = {op.name: (op.device, op.segment) for op in graph.ops}
    copies_at: dict[tuple, dict[tuple, list[str]]] = {}
    for op in graph.ops:
        reads: dict[str, str] = {}
        name, at = op.name, (op.device, op.segment)
        for piece in op.tensor_inputs:
            tensor, index, value = piece.tensor.name, piece.index, piece.value
            key = (tensor, index.ranges, value.part, value.parts)
            copies = exact.get(key)
            if copies and op.segment is not None:  # a pipelined reader uses the copy its own segment writes, if any
                copies = _copies_by_place(copies_at, key, copies, place).get(at) or copies
            if not copies:
                copies = overlapping.get(key[:2])
                if copies is None:
                    copies = overlapping[key[:2]] = writers[tensor].writers(index) if tensor in writers else []
            for producer in copies:
                if producer != name and producer not in reads:
                    reads[producer] = tensor
        edges[name] = reads
    return edges


def _copies_by_place(
    cache: dict[tuple, dict[tuple, list[str]]], key: tuple, copies: list[str],
    place: dict[str, tuple],
) -> dict[tuple, list[str]]:
    """The writers ``copies`` of one exact piece by their (device, segment), grouped once per piece (``cache``): a piece
    copied on every rank is read on every rank, and each reader looking through all copies would cost O(ranks²)."""
    grouped = cache.get(key)
    if grouped is None:
        grouped = cache[key] = defaultdict(list)
        for name in copies:
            grouped[place[name]].append(name)
    return grouped


class _BoxIndex:
    """The boxes written to one tensor, sorted along the dim they are most split on, to find overlaps.

    A query looks only at the boxes whose start on that dim lies in ``(start - widest, stop)``, found
    by bisection, so for pieces that tile a dim (what op_trans makes) a lookup costs O(log B + k) for
    B boxes and k overlaps, not a scan of all B: reading every piece of a tensor cut in B pieces is
    O(B log B), not O(B²).
    """

    _SCAN_BELOW = 8  # fewer boxes than this are scanned in full

    def __init__(self, boxes: dict[IndexMask, list[str]]) -> None:
        self.boxes = list(boxes)  # insertion (graph) order: the order writers are reported in
        self.names = list(boxes.values())
        self.dim = _most_split_dim(self.boxes) if len(self.boxes) >= self._SCAN_BELOW else None
        if self.dim is not None:
            self.by_start = sorted(range(len(self.boxes)), key=lambda position: self.boxes[position].ranges[self.dim][0])
            self.starts = [self.boxes[position].ranges[self.dim][0] for position in self.by_start]
            self.widest = max(stop - start for start, stop in (box.ranges[self.dim] for box in self.boxes))

    def writers(self, query: IndexMask) -> list[str]:
        """Names of the ops writing a box that overlaps ``query``, in graph order of their boxes."""
        if self.dim is None:
            positions = [p for p, box in enumerate(self.boxes) if _boxes_overlap(box, query)]
        else:
            start, stop = query.ranges[self.dim]
            candidates = self.by_start[bisect.bisect_right(self.starts, start - self.widest) : bisect.bisect_left(self.starts, stop)]
            positions = sorted(p for p in candidates if _boxes_overlap(self.boxes[p], query))
        return [name for position in positions for name in self.names[position]]


def _most_split_dim(boxes: list[IndexMask]) -> int | None:
    """The dim with the most distinct ranges among ``boxes`` (``None`` for scalars)."""
    dims = range(len(boxes[0].ranges))
    return max(dims, key=lambda dim: len({box.ranges[dim] for box in boxes}), default=None)


def _boxes_overlap(first: IndexMask, second: IndexMask) -> bool:
    # Same as ``first.intersect(second) is not None`` without building the intersection (hot loop).
    for (a_start, a_stop), (b_start, b_stop) in zip(first.ranges, second.ranges):
        if a_start >= b_stop or b_start >= a_stop:
            return False
    return True


def _device_sequence(graph: Graph) -> list[tuple[str, str]]:
    """``(previous, next)`` for consecutive ops of each device, in list order."""
    last_on_device: dict[int | None, str] = {}
    pairs = []
    for op in graph.ops:
        if op.device in last_on_device:
            pairs.append((last_on_device[op.device], op.name))
        last_on_device[op.device] = op.name
    return pairs


def _successors(graph: Graph, data: dict[str, dict[str, str]], edges: list[tuple[str, str]]) -> dict[str, list[str]]:
    """op name -> ops that must wait for it: data readers and ``edges`` targets, each once."""
    successors: dict[str, list[str]] = {op.name: [] for op in graph.ops}
    for consumer, reads in data.items():  # each consumer's producers are distinct: no reader is listed twice
        for producer in reads:
            successors[producer].append(consumer)
    for before, after in edges:
        if after not in successors[before]:
            successors[before].append(after)
    return successors


def _check_order_edges(graph: Graph) -> None:
    names = {op.name for op in graph.ops}
    for before, after in graph.order_edges:
        for name in (before, after):
            if name not in names:
                pieces = [op.name for op in graph.ops if op.origin == name]
                hint = f"; it was partitioned into {_name_list(pieces)}: order those pieces instead" if pieces else ""
                raise UnknownOpError(
                    f"order edge {before!r} -> {after!r} names op {name!r}, which is not in the graph{hint}"
                )


def _deadlock(graph: Graph, data: dict[str, dict[str, str]], cycle: list[str]) -> DeadlockError:
    """A DeadlockError listing the cycle, why each of its edges exists, and what to change."""
    order_edges = set(graph.order_edges)
    device_sequence = set(_device_sequence(graph))
    devices = {op.name: op.device for op in graph.ops}
    lines = [f"deadlock: these ops wait on each other in a cycle: {' -> '.join(cycle)}"]
    edge_kinds: set[str] = set()
    for before, after in zip(cycle, cycle[1:]):
        reasons: dict[str, str] = {}
        if before in data.get(after, {}):
            reasons["data"] = f"data: {after!r} reads %{data[after][before]} written by {before!r}"
        if (before, after) in order_edges:
            reasons["order"] = "order edge from op_order"
        if (before, after) in device_sequence:
            reasons["device"] = f"same device sequence: both on device {devices[before]}, {before!r} listed first"
        lines.append(f"  {before} -> {after}: {'; '.join(reasons.values())}")
        edge_kinds.add("device" if list(reasons) == ["device"] else "order" if "order" in reasons else "data")
    fix = next(text for kind, text in _DEADLOCK_FIXES.items() if kind in edge_kinds)
    lines.append(f"To fix: {fix}.")
    return DeadlockError("\n".join(lines), cycle)


def _name_list(names: list[str]) -> str:
    """``"3 ops ('a', 'b', 'c')"``, naming at most five."""
    shown = ", ".join(repr(name) for name in names[:_MAX_NAMED])
    more = f", and {len(names) - _MAX_NAMED} more" if len(names) > _MAX_NAMED else ""
    return f"{len(names)} ops ({shown}{more})"
