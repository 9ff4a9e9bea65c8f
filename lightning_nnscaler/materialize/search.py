"""RVD search: the cheapest sequence of collectives that turns one layout into another.

Pure planning: the result is a ``Path`` of ``Step``s (which collective, among which devices, how
many bytes); nothing here touches torch.distributed or moves a tensor. States are the layouts of
``layouts.py`` on the source or the target group, edges the transitions of the table below, and
Dijkstra finds the path of least cost under an injected ``CostModel``.

The point-to-point fallback (every target box fetched from the first holder of each overlap) is
an edge from the source straight to the target, so every search has an answer; uneven layouts
(a split that does not divide its dim) get exactly that answer. Its volume is also a budget: no
returned path puts more bytes on the wire than the fallback, and among those the search takes
the cheapest.

Transition table. ``f`` is a factor of the count moved; an in-group collective runs among the
``f`` devices whose coordinates differ only in the inner ``f``-part of the source axis, all such
sub-groups at once (``layouts.regroup_order``). ``n`` is the message size of the cost formulas:

    kind               axes      n (bytes per device)   volume per sub-group   effect on a device
    all-reduce         V  → R    piece                  2(f-1)·n               sums f value parts
    all-gather         Dk → R    piece·f (output)       (f-1)·n                joins f chunks of dim k
    reduce-scatter     V  → Dk   piece (input)          (f-1)·n                sums f parts, keeps 1/f of k
    all-to-all         Di → Dj   piece                  (f-1)·n                joins f chunks of i, keeps 1/f of j
    local-chunk        R  → Dk   -                      0                      keeps 1/f of dim k
    local-value-split  R  → V    -                      0                      part 0 keeps the value, others zeros
    local              → target  -                      0                      both of the above at once

The local steps are taken as the last step whenever every device already holds its target box
(the target decides which replica keeps which chunk); ``local-chunk`` is also an in-group move.

Between groups (disjoint or of another size, e.g. a pipeline stage boundary), and as the last
step onto the target: each target device fetches its box from holders of the overlapping source
pieces; value parts it needs more of are summed on arrival, the ones it needs fewer of become
zeros. ``n`` is the most bytes one device sends or receives, ``messages`` the most peers it has.

    move       1:1   same R·V·D on both sides (or fewer replicas)   holders spread over replicas
    broadcast  1:k   same V·D, more replicas on the target side      holders spread over replicas
    scatter    1:k   same V, every target split a multiple of the source split
    gather     k:1   same V, every source split a multiple of the target split
    p2p        any   the fallback and the fix of a device order: first holder of each overlap

Bounds on the state space, besides counts that divide the group and splits that divide their
dim: a move takes the largest factor both ends allow (the source axis's excess over the target's
count against what the target axis lacks), so it never undoes a count the target keeps, never
goes beyond the target's count, and is one collective, not a chain of small ones. Partial sums
are summed before they cross groups. Two moves may cut finer than the target where that pays: a
reduce-scatter before a crossing (less crosses), and a local chunk of all replicas while partial
sums remain (each replica sums a share, an all-gather joins the shares: hierarchical all-reduce).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property, lru_cache
from heapq import heappop, heappush
from itertools import product
from operator import itemgetter
from typing import Literal, Protocol

from lightning_nnscaler.ir.tensor import IndexMask, ValueMask
from lightning_nnscaler.materialize.layouts import (
    FIRST_DIM_AXIS,
    GEOMETRY_TABLES,
    REPLICA_AXIS,
    VALUE_AXIS,
    Layout,
    device_chunks,
    device_pieces,
    overlap_table,
    piece_holders,
    value_sources,
)

StepKind = Literal[
    "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "local-chunk", "local-value-split", "local",
    "move", "broadcast", "scatter", "gather", "p2p",
]
COLLECTIVE_KINDS = frozenset({"all-reduce", "all-gather", "reduce-scatter", "all-to-all"})
LOCAL_KINDS = frozenset({"local-chunk", "local-value-split", "local"})


@dataclass(frozen=True)
class Transfer:
    """One box sent point to point: ``source`` sends its value part ``value`` of ``index`` to ``target``."""

    source: int
    target: int
    index: IndexMask
    value: ValueMask


@dataclass(frozen=True)
class Step:
    """One transition of the table above, from layout ``before`` to layout ``after``.

    Attributes:
        kind: The row of the transition table.
        before: Layout before the step.
        after: Layout after the step (replicas in ascending device order).
        shape: Full shape of the tensor the byte counts refer to.
        dtype_bytes: Bytes per element.
        dims: Tensor dims involved: ``(k,)`` for all-gather, reduce-scatter, local-chunk;
            ``(i, j)`` for all-to-all (from dim i to dim j); empty otherwise.
        group_size: Devices per collective sub-group (1 for local and point-to-point steps).
        groups: Collectives: the sub-groups (devices) that run at once, members in chunk order.
        bytes_per_device: ``n`` of the cost formulas (see the table).
        volume: Bytes sent over the wire, summed over devices.
        messages: Point-to-point steps: the most peers one device sends to or receives from.
    """

    kind: StepKind
    before: Layout
    after: Layout
    shape: tuple[int, ...]
    dtype_bytes: int
    dims: tuple[int, ...] = ()
    group_size: int = 1
    groups: tuple[tuple[int, ...], ...] = ()
    bytes_per_device: int = 0
    volume: int = 0
    messages: int = 0

    @cached_property
    def transfers(self) -> tuple[Transfer, ...]:
        """Point-to-point steps: every box that moves (computed on first use); empty otherwise."""
        if self.kind in COLLECTIVE_KINDS or self.kind in LOCAL_KINDS:
            return ()
        return _exchange(self.kind, self.shape, self.dtype_bytes, self.before, self.after, keep=True)[1]

    def __str__(self) -> str:
        if self.kind in COLLECTIVE_KINDS:
            dims = "→".join(f"d{dim}" for dim in self.dims) or "V"
            return f"{self.kind}({dims}, {len(self.groups)}×{self.group_size})"
        if self.kind in LOCAL_KINDS:
            return self.kind + (f"(d{self.dims[0]})" if self.dims else "")
        return f"{self.kind}({self.messages} msg)"


@dataclass(frozen=True)
class Path:
    """The planned redistribution: ``steps`` in order, their total ``cost`` and ``volume`` (bytes)."""

    source: Layout
    target: Layout
    steps: tuple[Step, ...]
    cost: float
    volume: int

    @property
    def is_fallback(self) -> bool:
        """Whether the path is the point-to-point fallback."""
        return any(step.kind == "p2p" for step in self.steps)

    def __str__(self) -> str:
        return " → ".join(str(step) for step in self.steps) or "no-op"


class CostModel(Protocol):
    """Prices one step (seconds, or any additive unit). Must be hashable: searches are cached per model."""

    def step_cost(self, step: Step) -> float: ...


@dataclass(frozen=True)
class AlphaBeta:
    """α–β (latency–bandwidth) cost with the ring and pairwise-exchange formulas of collectives.

    Source: R. Thakur, R. Rabenseifner, W. Gropp, "Optimization of Collective Communication
    Operations in MPICH", IJHPCA 19(1), 2005 — ring all-gather (p-1)α + (p-1)/p·nβ, pairwise
    reduce-scatter and all-to-all (p-1)α + (p-1)/p·nβ, all-reduce as reduce-scatter + all-gather
    2(p-1)α + 2(p-1)/p·nβ (reduction compute ignored), point to point α + nβ per message. Every
    communicating step also pays ``launch`` once: a GPU collective is one kernel launch and one
    stream synchronization, whatever its group size, which the MPI model has no term for.

    Attributes:
        alpha: Seconds per message hop; 1 µs is the order of one NVLink/PCIe hop.
        beta: Seconds per byte; 1/100 GB/s is the order of one GPU's NVLink share.
        launch: Seconds per communicating step; 10 µs is the order of a launch plus a sync. Without
            it a chain of small collectives always beats one big ring on latency.
    """

    alpha: float = 1e-6
    beta: float = 1 / 100e9
    launch: float = 1e-5

    def step_cost(self, step: Step) -> float:
        p, n = step.group_size, step.bytes_per_device
        if step.kind in LOCAL_KINDS:
            return 0.0
        if step.kind == "all-reduce":
            return self.launch + 2 * (p - 1) * self.alpha + 2 * (p - 1) / p * n * self.beta
        if step.kind in COLLECTIVE_KINDS:
            return self.launch + (p - 1) * self.alpha + (p - 1) / p * n * self.beta
        return self.launch + step.messages * self.alpha + n * self.beta


DEFAULT_COST = AlphaBeta()


@dataclass(frozen=True)
class CollectivesOnly:
    """``cost`` for collectives; a point-to-point step costs so much that any collective path wins."""

    cost: CostModel

    def step_cost(self, step: Step) -> float:
        """The wrapped cost, times a large factor for point-to-point steps."""
        return self.cost.step_cost(step) * (1e9 if step.kind == "p2p" else 1.0)


def search(
    shape: tuple[int, ...], dtype_bytes: int, source: Layout, target: Layout, cost: CostModel = DEFAULT_COST
) -> Path:
    """The cheapest path from ``source`` to ``target`` for a tensor of ``shape`` (cached).

    Args:
        shape: Full tensor shape; each layout cuts ``len(shape)`` dims.
        dtype_bytes: Bytes per element.
        source: Where the tensor is now.
        target: Where it must be.
        cost: Prices each step; the same arguments return the same ``Path`` object.
    """
    shape = tuple(shape)
    for name, layout in (("source", source), ("target", target)):
        if len(layout.dim_splits) != len(shape):
            raise ValueError(
                f"{name} layout {layout} cuts {len(layout.dim_splits)} dims; the tensor {shape} has {len(shape)}: "
                "give the layout one split count per dim"
            )
    return _search(shape, dtype_bytes, source, target, cost)


def p2p_path(
    shape: tuple[int, ...], dtype_bytes: int, source: Layout, target: Layout, cost: CostModel = DEFAULT_COST
) -> Path:
    """The fallback: every target box fetched from the first source holder of each overlap."""
    step = _exchange_step("p2p", tuple(shape), dtype_bytes, source.normalized(), target.normalized())
    return Path(source, target, (step,), cost.step_cost(step), step.volume)


def clear_search_cache() -> None:
    """Forget every cached search and helper table (to time uncached searches)."""
    for cached in (_search, *GEOMETRY_TABLES):
        cached.cache_clear()


@lru_cache(maxsize=4096)
def _search(shape: tuple[int, ...], dtype_bytes: int, source: Layout, target: Layout, cost: CostModel) -> Path:
    """Dijkstra over layouts; a path may put at most as many bytes on the wire as the fallback."""
    start, goal = source.normalized(), target.normalized()
    if start == goal:
        return Path(source, target, (), 0.0, 0)
    fallback = _exchange_step("p2p", shape, dtype_bytes, start, goal)
    if not (source.is_even(shape) and target.is_even(shape)):
        return Path(source, target, (fallback,), cost.step_cost(fallback), fallback.volume)
    # label: (cost, point-to-point steps, steps, volume); ties go to fewer point-to-point steps
    # (collectives are the tuned primitives), then to fewer steps.
    best: dict[Layout, tuple[float, int, int, int]] = {start: (0.0, 0, 0, 0)}
    parent: dict[Layout, tuple[Layout, Step]] = {}
    queue, pushed, done = [(*best[start], 0, start)], 0, set()
    while queue:
        *label, _, layout = heappop(queue)
        if layout == goal:
            break
        if layout in done:
            continue
        done.add(layout)
        spent, fallbacks, hops, volume = label
        for step in _edges(shape, dtype_bytes, layout, start, goal, fallback, fallback.volume - volume):
            if step.after in done or volume + step.volume > fallback.volume:
                continue
            key = (spent + cost.step_cost(step), fallbacks + (step.kind == "p2p"), hops + 1, volume + step.volume)
            if key < best.get(step.after, (math.inf, 0, 0, 0)):
                best[step.after], parent[step.after] = key, (layout, step)
                pushed += 1
                heappush(queue, (*key, pushed, step.after))
    steps, layout = [], goal
    while layout != start:
        layout, step = parent[layout]
        steps.append(step)
    steps.reverse()
    return Path(source, target, tuple(steps), sum(map(cost.step_cost, steps)), sum(s.volume for s in steps))


def _edges(
    shape: tuple[int, ...], dtype_bytes: int, layout: Layout, start: Layout, goal: Layout, fallback: Step, budget: int
) -> Iterator[Step]:
    """Every step out of ``layout`` that may fit in ``budget`` more bytes on the wire.

    Finishes onto the target: a local step when every device holds its target box; otherwise the
    fallback from the source, and a p2p from layouts on the target group with the target's counts
    (a device-order fix). Then the in-group moves, and from the source group the crossings.
    """
    on_target = layout.group == goal.group
    finish = _local_finish_kind(shape, layout, goal) if on_target else None
    if finish is not None:
        yield Step(finish, layout, goal, shape, dtype_bytes)
    elif layout == start:
        yield fallback
    elif on_target and layout.counts == goal.counts:
        yield _exchange_step("p2p", shape, dtype_bytes, layout, goal)
    yield from _in_group_steps(shape, dtype_bytes, layout, goal.counts, before_crossing=not on_target)
    if not on_target:
        disjoint = layout.group.isdisjoint(goal.group)
        for kind, after in _crossings(shape, layout, goal):
            if disjoint and _fetched_bytes(shape, dtype_bytes, layout, after) > budget:
                continue  # every fetched byte crosses: the exact volume, known without the exchange
            yield _exchange_step(kind, shape, dtype_bytes, layout, after)


def _fetched_bytes(shape: tuple[int, ...], dtype_bytes: int, before: Layout, after: Layout) -> int:
    """Bytes the devices of ``after`` fetch from ``before`` when none of them holds any (even layouts)."""
    piece_bytes = math.prod(shape) // math.prod(after.dim_splits) * dtype_bytes
    parts = sum(len(value_sources(before.value_parts, after.value_parts, part)) for part in range(after.value_parts))
    return piece_bytes * parts * after.replicas * math.prod(after.dim_splits)


def _in_group_steps(
    shape: tuple[int, ...], dtype_bytes: int, layout: Layout, goal_counts: tuple[int, ...], *, before_crossing: bool
) -> Iterator[Step]:
    """Collectives and local chunks within the group of ``layout``, toward ``goal_counts``.

    Two moves may cut finer than the goal: a reduce-scatter before a crossing to another group
    (what crosses shrinks), and a local chunk of replicas while partial sums are still to be
    added (each replica then sums a share; an all-gather joins the shares again).
    """
    counts = layout.counts
    piece_bytes = math.prod(shape) // math.prod(layout.dim_splits) * dtype_bytes
    sums_ahead = goal_counts[VALUE_AXIS] % counts[VALUE_AXIS] != 0  # partial sums still to add up
    dim_axes = range(FIRST_DIM_AXIS, len(counts))
    moves = [(VALUE_AXIS, REPLICA_AXIS, "all-reduce")]
    moves += [(axis, REPLICA_AXIS, "all-gather") for axis in dim_axes]
    moves += [(VALUE_AXIS, axis, "reduce-scatter") for axis in dim_axes]
    moves += [(REPLICA_AXIS, axis, "local-chunk") for axis in dim_axes]
    moves += [(source, target, "all-to-all") for source in dim_axes for target in dim_axes if source != target]
    for source_axis, target_axis, kind in moves:
        # Move as much as both ends allow in one step: the excess of the source axis over the goal
        # (what the goal does not keep) against what the target axis lacks. Never undo a count the
        # goal keeps, never go beyond the goal's count; one collective, not a chain of small ones.
        excess = counts[source_axis] // math.gcd(counts[source_axis], goal_counts[source_axis])
        lacking, rest = divmod(goal_counts[target_axis], counts[target_axis])
        factor = math.gcd(excess, lacking) if rest == 0 else 1
        if (kind == "reduce-scatter" and before_crossing) or (kind == "local-chunk" and sums_ahead):
            # Cut finer than the goal where it pays: a reduce-scatter before a crossing sends less
            # across; replicas that split the data before a reduction sum less each (gathered after).
            factor = counts[source_axis] if kind == "local-chunk" else excess
            factor = factor if shape[target_axis - FIRST_DIM_AXIS] % (counts[target_axis] * factor) == 0 else 1
        if factor == 1:
            continue
        after, groups = layout.regroup(source_axis, target_axis, factor)
        dims = tuple(axis - FIRST_DIM_AXIS for axis in (source_axis, target_axis) if axis >= FIRST_DIM_AXIS)
        if kind in LOCAL_KINDS:
            yield Step(kind, layout, after.normalized(), shape, dtype_bytes, dims)
            continue
        message = piece_bytes * factor if kind == "all-gather" else piece_bytes
        per_group = (2 if kind == "all-reduce" else 1) * (factor - 1) * message
        volume = per_group * len(groups)
        yield Step(kind, layout, after.normalized(), shape, dtype_bytes, dims, factor, groups, message, volume)


def _crossings(shape: tuple[int, ...], layout: Layout, goal: Layout) -> Iterator[tuple[str, Layout]]:
    """Layouts on the target group one structured send away: same value split; each dim split as
    now or as the target's, all finer (scatter) or all coarser (gather) or equal (move, broadcast)."""
    size, value_parts = len(goal.devices), layout.value_parts
    if goal.value_parts % value_parts:
        return  # sum partial values before sending them: never more data across
    for splits in sorted(set(product(*({now, wanted} for now, wanted in zip(layout.dim_splits, goal.dim_splits))))):
        replicas, rest = divmod(size, value_parts * math.prod(splits))
        if rest or replicas == 0:
            continue
        if splits == layout.dim_splits:
            kind = "move" if replicas <= layout.replicas else "broadcast"
        elif all(new >= old for new, old in zip(splits, layout.dim_splits)):
            kind = "scatter"
        elif all(new <= old for new, old in zip(splits, layout.dim_splits)):
            kind = "gather"
        else:
            continue
        yield kind, Layout(replicas, value_parts, splits, goal.devices).normalized()


def _local_finish_kind(shape: tuple[int, ...], layout: Layout, goal: Layout) -> str | None:
    """The local step that ends at ``goal`` when every device holds its target box already, else None."""
    have, want = device_pieces(layout, shape), device_pieces(goal, shape)
    shrinks = splits = False
    for device, (ranges, part) in want.items():
        held_ranges, held_part = have[device]
        if any(start < low or stop > high for (start, stop), (low, high) in zip(ranges, held_ranges)):
            return None  # the device lacks part of its target box
        if layout.value_parts == 1:
            splits = splits or goal.value_parts > 1
        elif (layout.value_parts, held_part) != (goal.value_parts, part):
            return None
        shrinks = shrinks or ranges != held_ranges
    return "local" if shrinks and splits else "local-chunk" if shrinks else "local-value-split"


def _exchange_step(kind: str, shape: tuple[int, ...], dtype_bytes: int, before: Layout, after: Layout) -> Step:
    """A point-to-point step of ``kind`` (its transfers are listed only when asked for)."""
    (volume, bytes_per_device, messages), _ = _exchange(kind, shape, dtype_bytes, before, after, keep=False)
    return Step(
        kind, before, after, shape, dtype_bytes,
        bytes_per_device=bytes_per_device, volume=volume, messages=messages,
    )


def _exchange(
    kind: str, shape: tuple[int, ...], dtype_bytes: int, before: Layout, after: Layout, *, keep: bool
) -> tuple[tuple[int, int, int], tuple[Transfer, ...]]:
    """Each device of ``after`` fetches what it lacks from the holders in ``before``.

    Structured kinds pick the least-loaded holder of a replicated piece; ``p2p`` (the naive
    fallback) picks the first. A holder that is the receiver itself sends nothing.

    Returns:
        (volume, most bytes one device sends or receives, most peers of one device), and the
        transfers when ``keep``.
    """
    holders = piece_holders(before)
    overlaps = overlap_table(shape, dtype_bytes, before.dim_splits, after.dim_splits)
    wanted = [value_sources(before.value_parts, after.value_parts, part) for part in range(after.value_parts)]
    spread = kind != "p2p"
    sent: defaultdict[int, int] = defaultdict(int)
    received: defaultdict[int, int] = defaultdict(int)
    peers: set[tuple[int, int]] = set()
    transfers = []
    for device, part, chunks in device_chunks(after):
        for source_chunks, nbytes, ranges in overlaps[chunks] if wanted[part] else ():
            for source_part in wanted[part]:
                devices = holders[(source_part, source_chunks)]
                if device in devices:
                    continue
                holder = min(devices, key=sent.__getitem__) if spread and len(devices) > 1 else devices[0]
                sent[holder] += nbytes
                received[device] += nbytes
                peers.add((holder, device))
                if keep:
                    value = ValueMask(source_part, before.value_parts)
                    transfers.append(Transfer(holder, device, IndexMask(ranges), value))
    peer_counts = [*Counter(map(itemgetter(0), peers)).values(), *Counter(map(itemgetter(1), peers)).values()]
    totals = (sum(sent.values()), max([*sent.values(), *received.values(), 0]), max(peer_counts, default=0))
    return totals, tuple(transfers)
