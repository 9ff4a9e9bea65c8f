"""GradientReducer stage 0: bucketed all-reduces started by gradient hooks during backward.

Each scenario runs on in-memory thread ranks; the reference is the previous synchronous reducer
(every bucket all-reduced after backward), whose gradients the overlapped one must equal bit for bit.
"""

from __future__ import annotations

import time

import pytest
import torch

from lightning_nnscaler.runtime import CommunicationError, run_ranks
from lightning_nnscaler.runtime import autograd_comm as ac
from lightning_nnscaler.runtime import reducer as reducer_module
from lightning_nnscaler.runtime.reducer import GradientReducer

pytestmark = pytest.mark.timeout(60)

DIM = 6


def synchronous_sum(replicated: list[tuple[torch.nn.Parameter, tuple[int, ...]]], comm) -> None:
    """The previous stage-0 reducer: after backward, all-reduce each tuple's gradients in flat buckets."""
    by_group: dict[tuple[int, ...], list[torch.nn.Parameter]] = {}
    for parameter, ranks in replicated:
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        by_group.setdefault(ranks, []).append(parameter)
    for ranks, parameters in by_group.items():
        flat = torch.cat([parameter.grad.reshape(-1) for parameter in parameters])
        summed = comm.all_reduce(flat, ranks)
        offset = 0
        for parameter in parameters:
            parameter.grad.copy_(summed[offset : offset + parameter.numel()].view_as(parameter.grad))
            offset += parameter.numel()


def pair_of(rank: int, world_size: int) -> tuple[int, ...]:
    return tuple(range(world_size)) if world_size == 2 else (rank - rank % 2, rank - rank % 2 + 1)


def weights() -> dict[str, torch.Tensor]:
    """The replicated weights: the same values on every rank."""
    generator = torch.Generator().manual_seed(3)
    return {
        "wa": torch.randn(DIM, DIM, dtype=torch.float64, generator=generator),
        "wb": torch.randn(DIM, DIM, dtype=torch.float64, generator=generator),
        "bias": torch.randn(DIM, dtype=torch.float64, generator=generator),
        "pair": torch.randn(DIM, DIM, dtype=torch.float64, generator=generator),
        "unused": torch.randn(3, dtype=torch.float64, generator=generator),
    }


def interleaved_step(comm, overlapped: bool, slow_rank: int | None = 0) -> dict:
    """One data-parallel step whose backward also runs token-chained collectives over the same tuples.

    Even ranks apply ``wa`` then ``wb``, odd ranks ``wb`` then ``wa``, so their hooks fire in
    different orders; ``slow_rank`` sleeps in a hook, so the ranks reach the collectives at
    different times. ``unused`` gets no gradient.
    """
    rank, n = comm.rank, comm.world_size
    everyone, pair = tuple(range(n)), pair_of(rank, n)
    comm.create_groups([everyone, pair])
    params = {name: torch.nn.Parameter(value.clone()) for name, value in weights().items()}
    groups = {"pair": pair}
    replicated = [(params[name], groups.get(name, everyone)) for name in params]
    reducer = GradientReducer(replicated, comm, rank) if overlapped else None
    if rank == slow_rank:
        params["wa"].register_post_accumulate_grad_hook(lambda _: time.sleep(0.05))
    x = torch.randn(4, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(20 + rank))
    first, second = ("wa", "wb") if rank % 2 == 0 else ("wb", "wa")
    token = ac.new_token()
    h = x @ params[first]
    h, token = ac.all_reduce(token, h, everyone, comm)
    h = h.tanh() @ params["pair"]
    gathered, token = ac.all_gather(token, h, 0, pair, comm)
    y = gathered.sin() @ params[second] + params["bias"]
    ac.backward(token, [y.square().sum()])
    comm.wait_sends()
    if overlapped:
        reducer.after_backward()
    else:
        synchronous_sum(replicated, comm)
    return {
        "gradients": {name: param.grad for name, param in params.items()},
        "started": list(reducer.started_buckets) if overlapped else None,
    }


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("bucket_bytes", [1, 2 * DIM * DIM * 8, reducer_module.BUCKET_BYTES])
def test_overlapped_gradients_equal_the_synchronous_ones_bit_for_bit(world_size, bucket_bytes, monkeypatch):
    monkeypatch.setattr(reducer_module, "BUCKET_BYTES", bucket_bytes)
    expected = run_ranks(world_size, lambda comm: interleaved_step(comm, overlapped=False), timeout=10)
    actual = run_ranks(world_size, lambda comm: interleaved_step(comm, overlapped=True), timeout=10)
    for rank in range(world_size):
        for name, grad in expected[rank]["gradients"].items():
            assert torch.equal(actual[rank]["gradients"][name], grad), f"{name} on rank {rank}"
        assert torch.equal(actual[rank]["gradients"]["unused"], torch.zeros(3, dtype=torch.float64))
    for name in expected[0]["gradients"]:
        assert all(torch.equal(actual[r]["gradients"][name], actual[0]["gradients"][name]) for r in pair_of(0, world_size))


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("slow_rank", [0, 1])
def test_buckets_start_in_index_order_on_every_rank_whatever_order_hooks_fire_in(world_size, slow_rank, monkeypatch):
    monkeypatch.setattr(reducer_module, "BUCKET_BYTES", 1)  # a bucket per box
    results = run_ranks(world_size, lambda comm: interleaved_step(comm, overlapped=True, slow_rank=slow_rank), timeout=10)
    everyone = tuple(range(world_size))
    for rank, result in enumerate(results):
        world_buckets = [(index, during) for ranks, index, during in result["started"] if ranks == everyone]
        # buckets over the world, reverse registration order: unused, (pair if 2 ranks,) bias, wb, wa
        assert [index for index, _ in world_buckets] == list(range(5 if world_size == 2 else 4))
        # "unused" gets no gradient: after_backward starts it, so every later bucket waits for it too
        assert world_buckets[0][1] is False


def test_buckets_start_during_backward_before_it_ends(monkeypatch):
    monkeypatch.setattr(reducer_module, "BUCKET_BYTES", 1)

    def step(comm):
        everyone = tuple(range(comm.world_size))
        generator = torch.Generator().manual_seed(5)
        layers = [torch.nn.Parameter(torch.randn(DIM, DIM, generator=generator)) for _ in range(3)]
        reducer = GradientReducer([(layer, everyone) for layer in layers], comm, comm.rank)
        events = []
        for number, layer in enumerate(layers):
            layer.register_post_accumulate_grad_hook(lambda _, number=number: events.append(f"grad {number}"))
        x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(comm.rank)).requires_grad_(True)
        x.register_hook(lambda grad: events.append(f"input grad after {len(reducer.started_buckets)} starts"))
        h = x
        for layer in layers:
            h = (h @ layer).tanh()
        h.sum().backward()
        events.append(f"backward ended after {len(reducer.started_buckets)} starts")
        reducer.after_backward()
        return events, list(reducer.started_buckets), [layer.grad for layer in layers]

    results = run_ranks(2, step, timeout=10)
    for events, started, _ in results:
        assert events[:2] == ["grad 2", "grad 1"] and "grad 0" in events  # last layer first
        # the two last layers' buckets started while backward still had the input's gradient to compute
        assert any(event.startswith("input grad after") and int(event.split()[3]) >= 2 for event in events)
        assert events[-1] == "backward ended after 3 starts"
        assert started == [((0, 1), 0, True), ((0, 1), 1, True), ((0, 1), 2, True)]
    for a, b in zip(results[0][2], results[1][2]):
        assert torch.equal(a, b)


def test_in_memory_all_reduce_async_does_not_block_when_it_starts():
    """Rank 0 starts an async sum, then blocks in a collective rank 1 reaches only after starting its own."""

    def program(comm):
        everyone = (0, 1)
        x = torch.full((3,), float(comm.rank + 1))
        if comm.rank == 0:
            handle = comm.all_reduce_async(x, everyone)
            blocking = comm.all_reduce(x * 10, everyone)
        else:
            blocking = comm.all_reduce(x * 10, everyone)
            handle = comm.all_reduce_async(x, everyone)
        return handle.wait(), blocking

    for summed, blocking in run_ranks(2, program, timeout=5):
        assert torch.equal(summed, torch.full((3,), 3.0))
        assert torch.equal(blocking, torch.full((3,), 30.0))


def test_in_memory_async_sums_that_disagree_raise():
    def program(comm):
        handle = comm.all_reduce_async(torch.ones(2 + comm.rank), (0, 1))
        return handle.wait()

    with pytest.raises(CommunicationError, match="all_reduce_async"):
        run_ranks(2, program, timeout=5)


def test_a_gradient_after_its_bucket_started_raises():
    def program(comm):
        weight = torch.nn.Parameter(torch.ones(2))
        reducer = GradientReducer([(weight, (0, 1))], comm, comm.rank)
        (weight * 2).sum().backward()
        try:
            (weight * 3).sum().backward()
        except RuntimeError as error:
            message = str(error)
        reducer.after_backward()
        return message, weight.grad

    for message, grad in run_ranks(2, program, timeout=5):
        assert "after its bucket's all-reduce started" in message
        assert torch.equal(grad, torch.full((2,), 4.0))  # the sum of what each rank had when the bucket started


def two_layer_step(comm, reducer: GradientReducer, layers: list[torch.nn.Parameter], seed: int, *, reduce: bool = True) -> None:
    """One backward of a rank-dependent loss through ``layers``, with the reducer's calls around it."""
    x = torch.randn(4, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(100 * seed + comm.rank))
    reducer.before_backward(reduce)
    (x @ layers[0]).tanh().matmul(layers[1]).square().sum().backward()
    reducer.after_backward()


def reference_sum(comm, layers: list[torch.nn.Parameter], seeds: list[int]) -> list[torch.Tensor]:
    """Each rank's local gradients of every step, accumulated, then all-reduced synchronously."""
    copies = [torch.nn.Parameter(layer.detach().clone()) for layer in layers]
    for seed in seeds:
        x = torch.randn(4, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(100 * seed + comm.rank))
        (x @ copies[0]).tanh().matmul(copies[1]).square().sum().backward()
    synchronous_sum([(copy, tuple(range(comm.world_size))) for copy in copies], comm)
    return [copy.grad for copy in copies]


def layers_and_reducer(comm, bucket_bytes: int | None = None) -> tuple[list[torch.nn.Parameter], GradientReducer]:
    generator = torch.Generator().manual_seed(9)
    layers = [torch.nn.Parameter(torch.randn(DIM, DIM, dtype=torch.float64, generator=generator)) for _ in range(2)]
    everyone = tuple(range(comm.world_size))
    return layers, GradientReducer([(layer, everyone) for layer in layers], comm, comm.rank, bucket_bytes=bucket_bytes)


def test_summed_gradients_are_views_of_one_bucket_buffer_that_the_next_step_reuses():
    def program(comm):
        layers, reducer = layers_and_reducer(comm)
        two_layer_step(comm, reducer, layers, seed=1)
        (bucket,) = reducer._buckets
        first = [layer.grad for layer in layers]
        first_values = [grad.clone() for grad in first]
        for layer in layers:
            layer.grad = None  # what Lightning's zero_grad does
        two_layer_step(comm, reducer, layers, seed=2)
        buffer = bucket.buffer.untyped_storage()
        return {
            "one_storage": all(layer.grad.untyped_storage().data_ptr() == buffer.data_ptr() for layer in layers),
            "same_place_both_steps": [layer.grad.data_ptr() for layer in layers] == [grad.data_ptr() for grad in first],
            "bucket_bytes": bucket.buffer.numel() * bucket.buffer.element_size(),
            "gradient_bytes": sum(layer.numel() * layer.element_size() for layer in layers),
            "first": first_values,
            "second": [layer.grad for layer in layers],
            "expected": [reference_sum(comm, layers, [1]), reference_sum(comm, layers, [2])],
        }

    for result in run_ranks(2, program, timeout=10):
        assert result["one_storage"] and result["same_place_both_steps"]
        assert result["bucket_bytes"] == result["gradient_bytes"]  # one copy of the gradients, no second buffer
        for actual, expected in zip([result["first"], result["second"]], result["expected"]):
            assert all(torch.equal(a, e) for a, e in zip(actual, expected))


def test_each_bucket_is_reported_in_start_order_with_its_sum_in_place():
    def program(comm):
        layers, reducer = layers_and_reducer(comm, bucket_bytes=1)  # a bucket per layer
        reported = []
        reducer.on_bucket_reduced = lambda boxes: reported.append([(id(box) == id(layers[0]), box.grad.clone()) for box in boxes])
        two_layer_step(comm, reducer, layers, seed=1)
        return reported, reference_sum(comm, layers, [1])

    for reported, expected in run_ranks(2, program, timeout=10):
        assert [[is_first for is_first, _ in bucket] for bucket in reported] == [[False], [True]]  # reverse registration order
        assert torch.equal(reported[0][0][1], expected[1]) and torch.equal(reported[1][0][1], expected[0])


def test_a_local_backward_then_a_summing_one_sum_the_accumulated_gradients_once():
    def program(comm):
        layers, reducer = layers_and_reducer(comm)
        two_layer_step(comm, reducer, layers, seed=1, reduce=False)
        local_started = list(reducer.started_buckets)
        two_layer_step(comm, reducer, layers, seed=2)
        return local_started, [layer.grad for layer in layers], reference_sum(comm, layers, [1, 2])

    for local_started, actual, expected in run_ranks(2, program, timeout=10):
        assert local_started == []
        assert all(torch.equal(a, e) for a, e in zip(actual, expected))


def test_summed_gradients_left_in_place_accumulate_as_in_torch():
    def program(comm):
        layers, reducer = layers_and_reducer(comm, bucket_bytes=1)  # a bucket per layer
        two_layer_step(comm, reducer, layers, seed=1)
        two_layer_step(comm, reducer, layers, seed=2)  # nobody cleared the first step's sums
        expected = [a + b for a, b in zip(reference_sum(comm, layers, [1]), reference_sum(comm, layers, [2]))]
        return [layer.grad for layer in layers], expected

    for actual, expected in run_ranks(2, program, timeout=10):
        assert all(torch.equal(a, e) for a, e in zip(actual, expected))
