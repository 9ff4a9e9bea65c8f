"""Plan validation: placement, device range, order edges, deadlock cycles, data dependencies."""

from __future__ import annotations

import time

import pytest

from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir.op import Op
from lightning_nnscaler.ir.tensor import PTensor
from lightning_nnscaler.ir.validate import (
    DeadlockError,
    DeviceOutOfRangeError,
    PlanError,
    UnassignedOpError,
    UnknownOpError,
    data_dependencies,
    find_cycle,
    stable_topological_order,
    validate_plan,
)

TWO_DEVICE_PLAN = """
tensor %x: float32[4, 8] input
tensor %w: float32[8, 8] parameter "w" grad
tensor %h: float32[4, 8] activation
tensor %y: float32[4, 8] activation
op mm.0 @0 from mm = aten.mm.default(%x[0:2, 0:8], %w) -> %h[0:2, 0:8]
op mm.1 @1 from mm = aten.mm.default(%x[2:4, 0:8], %w) -> %h[2:4, 0:8]
op relu.0 @0 from relu = aten.relu.default(%h[0:2, 0:8]) -> %y[0:2, 0:8]
op relu.1 @1 from relu = aten.relu.default(%h[2:4, 0:8]) -> %y[2:4, 0:8]
output %y
order mm.0 -> mm.1
"""

# Three independent ops (each reads only the input) and one that reads a's output.
INDEPENDENT = """
tensor %x: float32[4] input
tensor %y: float32[4] activation
tensor %z: float32[4] activation
tensor %u: float32[4] activation
tensor %v: float32[4] activation
op a @0 = aten.relu.default(%x) -> %y
op b @0 = aten.neg.default(%x) -> %z
op c @1 = aten.exp.default(%x) -> %u
op d @1 = aten.neg.default(%y) -> %v
"""


def chain_graph(length: int) -> Graph:
    """``relu_0 -> relu_1 -> ...``, alternating devices 0 and 1."""
    tensors = [PTensor(f"t{i}", (4, 4), role="input" if i == 0 else "activation") for i in range(length + 1)]
    graph = Graph(tensors={tensor.name: tensor for tensor in tensors}, inputs=["t0"], outputs=[f"t{length}"])
    graph.ops = [
        Op(f"relu_{i}", "aten.relu.default", (tensors[i].full(),), outputs=(tensors[i + 1].full(),), device=i % 2)
        for i in range(length)
    ]
    return graph


def test_a_valid_two_device_plan_passes() -> None:
    graph = Graph.from_text(TWO_DEVICE_PLAN)
    validate_plan(graph, world_size=2)
    validate_plan(graph)
    assert [op.name for op in stable_topological_order(graph)] == ["mm.0", "mm.1", "relu.0", "relu.1"]


def test_an_unassigned_op_is_rejected_by_name() -> None:
    graph = Graph.from_text(TWO_DEVICE_PLAN.replace("op relu.1 @1", "op relu.1"))
    message = r"op 'relu.1' is not assigned to a device; call op_assign\(graph, op, device\)"
    with pytest.raises(UnassignedOpError, match=message):
        validate_plan(graph)


def test_many_unassigned_ops_are_counted_and_five_named() -> None:
    graph = chain_graph(7)
    graph.ops = [Op(op.name, op.target, op.args, outputs=op.outputs) for op in graph.ops]
    with pytest.raises(UnassignedOpError) as caught:
        validate_plan(graph)
    assert "7 ops ('relu_0', 'relu_1', 'relu_2', 'relu_3', 'relu_4', and 2 more) are not assigned" in str(caught.value)
    assert isinstance(caught.value, PlanError) and isinstance(caught.value, ValueError)


def test_a_device_out_of_range_is_rejected_naming_op_and_device() -> None:
    graph = Graph.from_text(TWO_DEVICE_PLAN.replace("op relu.1 @1", "op relu.1 @2"))
    validate_plan(graph)  # no world size: any device goes
    message = r"op 'relu.1' is on device 2, outside the 2 devices 0\.\.1 of world_size 2"
    with pytest.raises(DeviceOutOfRangeError, match=message):
        validate_plan(graph, world_size=2)


def test_an_order_edge_naming_a_missing_op_is_rejected() -> None:
    graph = Graph.from_text(TWO_DEVICE_PLAN + "order relu -> mm.1\n")
    message = r"order edge 'relu' -> 'mm.1' names op 'relu'.*partitioned into 2 ops \('relu.0', 'relu.1'\)"
    with pytest.raises(UnknownOpError, match=message):
        validate_plan(graph)
    with pytest.raises(UnknownOpError):
        stable_topological_order(graph)


def test_order_edges_both_ways_are_a_deadlock() -> None:
    graph = Graph.from_text(INDEPENDENT + "order b -> c\norder c -> b\n")
    with pytest.raises(DeadlockError) as caught:
        validate_plan(graph, world_size=2)
    assert caught.value.cycle == ["b", "c", "b"]
    assert str(caught.value).splitlines()[:3] == [
        "deadlock: these ops wait on each other in a cycle: b -> c -> b",
        "  b -> c: order edge from op_order",
        "  c -> b: order edge from op_order",
    ]
    assert "remove one of the op_order edges" in str(caught.value)
    with pytest.raises(DeadlockError) as caught:
        stable_topological_order(graph)
    assert caught.value.cycle == ["b", "c", "b"]


def test_a_cycle_of_a_data_dependency_and_order_edges_is_listed_in_order() -> None:
    graph = Graph.from_text(INDEPENDENT + "order d -> c\norder c -> a\n")
    with pytest.raises(DeadlockError) as caught:
        validate_plan(graph)
    assert caught.value.cycle == ["a", "d", "c", "a"]
    assert str(caught.value).splitlines()[:4] == [
        "deadlock: these ops wait on each other in a cycle: a -> d -> c -> a",
        "  a -> d: data: 'd' reads %y written by 'a'",
        "  d -> c: order edge from op_order",
        "  c -> a: order edge from op_order",
    ]


def test_an_order_against_the_list_order_of_a_device_is_reported_and_fixed() -> None:
    graph = Graph.from_text(INDEPENDENT + "order b -> a\n")
    with pytest.raises(DeadlockError) as caught:
        validate_plan(graph, world_size=2)
    assert caught.value.cycle == ["a", "b", "a"]
    assert str(caught.value).splitlines()[1:3] == [
        "  a -> b: same device sequence: both on device 0, 'a' listed first",
        "  b -> a: order edge from op_order",
    ]
    assert "stable_topological_order(graph)" in str(caught.value)

    graph.ops = stable_topological_order(graph)
    assert [op.name for op in graph.ops] == ["b", "a", "c", "d"]  # a moves only as far as it must
    validate_plan(graph, world_size=2)


def test_an_order_across_devices_needs_no_reordering() -> None:
    graph = Graph.from_text(INDEPENDENT + "order c -> b\n")
    validate_plan(graph, world_size=2)
    assert [op.name for op in stable_topological_order(graph)] == ["a", "c", "b", "d"]


def test_data_dependencies_follow_overlapping_pieces() -> None:
    graph = Graph.from_text(
        """
        tensor %x: float32[4, 2] input
        tensor %y: float32[4, 2] activation
        tensor %s: float32[2] activation
        tensor %u: float32[2, 2] activation
        tensor %v: float32[2, 2] activation
        tensor %w: float32[2] activation
        op A = aten.relu.default(%x[0:2, 0:2]) -> %y[0:2, 0:2]
        op B = aten.relu.default(%x[2:4, 0:2]) -> %y[2:4, 0:2]
        op middle = aten.relu.default(%y[1:3, 0:2]) -> %u
        op top = aten.relu.default(%y[0:2, 0:2]) -> %v
        op partial.0 = aten.sum.dim_IntList(%y[0:2, 0:2], [0]) -> %s{0/2}
        op partial.1 = aten.sum.dim_IntList(%y[2:4, 0:2], [0]) -> %s{1/2}
        op total = aten.relu.default(%s) -> %w
        """
    )
    assert data_dependencies(graph) == {
        "A": [],
        "B": [],
        "middle": ["A", "B"],
        "top": ["A"],
        "partial.0": ["A"],
        "partial.1": ["B"],
        "total": ["partial.0", "partial.1"],  # value shares are writes whatever their part
    }


def test_find_cycle() -> None:
    assert find_cycle(["a", "b", "c"], {"a": ["b"], "b": ["c"]}) is None
    assert find_cycle(["a"], {"a": ["a"]}) == ["a", "a"]
    assert find_cycle(["a", "b", "c"], {"c": ["b"], "b": ["a"], "a": ["c"]}) == ["a", "c", "b", "a"]
    # Far deeper than Python's recursion limit.
    names = [f"n{i}" for i in range(50_000)]
    edges = {name: [following] for name, following in zip(names, names[1:])}
    assert find_cycle(names, edges) is None
    edges[names[-1]] = [names[10]]
    assert find_cycle(names, edges) == names[10:] + [names[10]]


def test_a_chain_of_5000_ops_validates_quickly() -> None:
    graph = chain_graph(5000)
    start = time.perf_counter()
    validate_plan(graph, world_size=2)
    assert stable_topological_order(graph) == list(graph.ops)
    assert time.perf_counter() - start < 2.0
