"""op_orders: many happens-before edges with one re-sort, a rollback on a cycle, and work linear in the plan."""

from __future__ import annotations

import random
import sys
from typing import Callable

import pytest

from lightning_nnscaler.ir.graph import Graph, GraphError
from lightning_nnscaler.ir.op import Op
from lightning_nnscaler.ir.tensor import IndexMask, PTensor, VTensor
from lightning_nnscaler.ir.validate import DeadlockError, data_dependencies, validate_plan
from lightning_nnscaler.primitives import op_assign, op_order, op_orders
from lightning_nnscaler.primitives import order as order_module


def pipeline_graph(stages: int, ops_per_stage: int, microbatches: int) -> Graph:
    """A chain of ``relu_i`` ops, each cut by rows into one piece per microbatch; stage ``s`` on device ``s``."""
    length = stages * ops_per_stage
    tensors = [PTensor(f"t{i}", (microbatches, 4), role="input" if i == 0 else "activation") for i in range(length + 1)]
    graph = Graph(tensors={tensor.name: tensor for tensor in tensors}, inputs=["t0"], outputs=[f"t{length}"])
    rows = [[tensor.full().split_dim(0, microbatches)] for tensor in tensors]
    graph.ops = [
        Op(f"relu_{i}.{mb}", "aten.relu.default", (rows[i][0][mb],), outputs=(rows[i + 1][0][mb],), device=i // ops_per_stage, origin=f"relu_{i}")
        for i in range(length)
        for mb in range(microbatches)
    ]
    return graph


def segment(stage: int, microbatch: int, ops_per_stage: int) -> list[str]:
    """The pieces of one (stage, microbatch): forward(stage, microbatch)."""
    return [f"relu_{i}.{microbatch}" for i in range(stage * ops_per_stage, (stage + 1) * ops_per_stage)]


def schedule_edges(stages: int, ops_per_stage: int, microbatches: int) -> list[tuple[str, str]]:
    """Each device runs its segments microbatch after microbatch: the ops of a segment in a chain,
    and the last op of forward(s, mb) before the first op of forward(s, mb + 1)."""
    edges = []
    for stage in range(stages):
        sequence = [name for microbatch in range(microbatches) for name in segment(stage, microbatch, ops_per_stage)]
        edges += list(zip(sequence, sequence[1:]))
    return edges


def names(graph: Graph) -> list[str]:
    return [op.name for op in graph.ops]


def test_many_edges_at_once_equal_adding_them_one_by_one() -> None:
    stages, ops_per_stage, microbatches = 3, 4, 4
    edges = schedule_edges(stages, ops_per_stage, microbatches)
    at_once, one_by_one, shuffled = (pipeline_graph(stages, ops_per_stage, microbatches) for _ in range(3))
    op_orders(at_once, edges)
    for before, after in edges:
        op_order(one_by_one, before, after)
    op_orders(shuffled, random.Random(0).sample(edges, len(edges)))
    assert at_once.order_edges == one_by_one.order_edges == edges
    assert names(at_once) == names(one_by_one) == names(shuffled)
    for stage in range(stages):
        on_device = [op.name for op in at_once.ops if op.device == stage]
        assert on_device == [name for mb in range(microbatches) for name in segment(stage, mb, ops_per_stage)]


def test_op_orders_moves_ops_as_little_as_possible_from_the_order_before_the_call() -> None:
    # Three independent pieces; c must come before both a and b.
    edges = [("relu_0.2", "relu_0.0"), ("relu_0.2", "relu_0.1")]
    at_once, one_by_one = pipeline_graph(1, 1, 3), pipeline_graph(1, 1, 3)
    op_orders(at_once, edges)
    for before, after in edges:
        op_order(one_by_one, before, after)
    assert names(at_once) == ["relu_0.2", "relu_0.0", "relu_0.1"]
    assert names(one_by_one) == ["relu_0.2", "relu_0.1", "relu_0.0"]  # each call starts from the last call's order


def test_a_cycle_among_many_edges_is_refused_naming_it_and_the_graph_is_unchanged() -> None:
    graph = pipeline_graph(2, 3, 4)
    op_order(graph, "relu_0.3", "relu_0.2")
    ops_before, edges_before = list(graph.ops), list(graph.order_edges)
    edges = schedule_edges(2, 3, 4)
    edges[len(edges) // 2 : len(edges) // 2] = [("relu_4.1", "relu_4.2"), ("relu_4.2", "relu_4.1")]
    with pytest.raises(DeadlockError) as caught:
        op_orders(graph, edges)
    cycle = caught.value.cycle
    steps = list(zip(cycle, cycle[1:]))
    data = data_dependencies(graph)
    assert cycle[0] == cycle[-1] and ("relu_4.2", "relu_4.1") in steps
    assert all(step in edges or step[0] in data[step[1]] for step in steps)
    assert "relu_4.2 -> relu_4.1: order edge from op_order" in str(caught.value)
    assert list(graph.ops) == ops_before and graph.order_edges == edges_before


def test_an_edge_against_the_data_flow_is_refused_and_the_graph_is_unchanged() -> None:
    graph = pipeline_graph(2, 3, 2)
    ops_before = list(graph.ops)
    with pytest.raises(DeadlockError) as caught:
        op_orders(graph, schedule_edges(2, 3, 2) + [("relu_5.0", "relu_0.0")])
    assert caught.value.cycle[0] == caught.value.cycle[-1] and {"relu_5.0", "relu_0.0"} <= set(caught.value.cycle)
    assert list(graph.ops) == ops_before and graph.order_edges == []


def test_an_unknown_op_adds_no_edge_and_names_the_pieces() -> None:
    graph = pipeline_graph(1, 2, 2)
    with pytest.raises(GraphError, match=r"'relu_0'.*partitioned into \['relu_0.0', 'relu_0.1'\]"):
        op_orders(graph, [("relu_0.0", "relu_0.1"), ("relu_0", "relu_1.0")])
    assert graph.order_edges == []


def test_many_edges_cost_one_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    sorts = []
    sort = order_module.stable_topological_order
    monkeypatch.setattr(order_module, "stable_topological_order", lambda graph: sorts.append(1) or sort(graph))
    graph = pipeline_graph(4, 8, 8)
    op_orders(graph, schedule_edges(4, 8, 8))
    assert len(sorts) == 1 and len(graph.order_edges) == 4 * 8 * 8 - 4


def python_steps(function: Callable[[], object]) -> int:
    """Python calls, lines and returns that ``function`` executes: a count of work that a loaded machine does not skew."""
    steps = 0

    def count(frame, event, arg):  # noqa: ANN001, ANN202 (sys.settrace's signature)
        nonlocal steps
        steps += 1
        return count

    previous = sys.gettrace()
    sys.settrace(count)
    try:
        function()
    finally:
        sys.settrace(previous)
    return steps


def test_op_orders_work_grows_linearly_with_the_plan() -> None:
    # 512 vs 4096 pieces and about as many edges: linear work is 8x, quadratic would be 64x.
    small, large = pipeline_graph(4, 16, 8), pipeline_graph(4, 128, 8)
    small_steps = python_steps(lambda: op_orders(small, schedule_edges(4, 16, 8)))
    large_steps = python_steps(lambda: op_orders(large, schedule_edges(4, 128, 8)))
    assert large_steps / small_steps < 8 * 1.5


def split_tensor_graph(pieces: int, shift: int) -> Graph:
    """``pieces`` ops write the rows of %x in ``pieces`` pieces; ``pieces`` ops read rows shifted by ``shift``."""
    x = PTensor("x", (pieces * 4, 2), role="activation")
    tensors = {"x": x} | {f"y{i}": PTensor(f"y{i}", (4, 2), role="activation") for i in range(pieces)}
    writers = [Op(f"w{i}", "aten.zeros.default", (), outputs=(piece,)) for i, piece in enumerate(x.full().split_dim(0, pieces))]
    readers = [
        Op(f"r{i}", "aten.relu.default", (VTensor(x, IndexMask(((start, start + 4), (0, 2)))),), outputs=(tensors[f"y{i}"].full(),))
        for i, start in enumerate(range(shift, pieces * 4 - 4, 4))
    ]
    return Graph(tensors=tensors, ops=writers + readers)


def test_data_dependencies_of_a_tensor_cut_in_many_pieces() -> None:
    dependencies = data_dependencies(split_tensor_graph(16, shift=2))
    assert dependencies["r0"] == ["w0", "w1"] and dependencies["r14"] == ["w14", "w15"]
    assert data_dependencies(split_tensor_graph(16, shift=0))["r3"] == ["w3"]
    small = split_tensor_graph(128, shift=2)
    large = split_tensor_graph(1024, shift=2)
    small_steps, large_steps = python_steps(lambda: data_dependencies(small)), python_steps(lambda: data_dependencies(large))
    assert large_steps / small_steps < 8 * 1.5  # every reader against every writer would be 64x


def test_a_graph_op_orders_sorted_validates_without_a_cycle_search_until_an_edit() -> None:
    graph = pipeline_graph(stages=2, ops_per_stage=2, microbatches=2)
    op_orders(graph, schedule_edges(2, 2, 2))
    assert graph.in_dependency_order
    validate_plan(graph, 2)
    graph.order_edges.append(("relu_3.1", "relu_0.0"))  # against the data flow: only a cycle search finds it
    assert not graph.in_dependency_order
    with pytest.raises(DeadlockError):
        validate_plan(graph, 2)
    graph.order_edges.pop()
    assert graph.in_dependency_order
    op_assign(graph, "relu_0.0", 1)
    assert not graph.in_dependency_order
    validate_plan(graph, 2)
