"""Token-chained autograd communication on thread ranks: values and gradients equal a single-process reference.

The reference computes every rank's output from all ranks' inputs in one process and
differentiates the sum of every rank's loss: "every consumer's contribution is summed".
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from lightning_nnscaler.runtime import CommunicationError, run_ranks
from lightning_nnscaler.runtime import autograd_comm as ac
from lightning_nnscaler.runtime.autograd_comm import BACKWARD_TAG_OFFSET

pytestmark = pytest.mark.timeout(60)

SHAPE = (4, 6)  # dim 0 splits into 2 or 4 chunks


def rank_input(rank: int) -> torch.Tensor:
    return torch.randn(SHAPE, dtype=torch.float64, generator=torch.Generator().manual_seed(10 + rank))


def rank_weight(rank: int, shape: torch.Size) -> torch.Tensor:
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(50 + rank))


@dataclass(frozen=True)
class Case:
    """``program(comm, token, x) -> (y, token)`` on each rank; ``reference(xs) -> ys`` in one process."""

    name: str
    program: Callable
    reference: Callable


def pair_of(rank: int, world_size: int) -> tuple[int, ...]:
    """Ranks (0, 1), (2, 3), ...: the subgroups of the subgroup cases."""
    return tuple(range(world_size)) if world_size == 2 else (rank - rank % 2, rank - rank % 2 + 1)


def world(n: int) -> tuple[int, ...]:
    return tuple(range(n))


CASES = [
    Case(
        "all_reduce",
        lambda comm, token, x: ac.all_reduce(token, x, world(comm.world_size), comm),
        lambda xs: [sum(xs)] * len(xs),
    ),
    Case(
        "all_reduce_pairs",
        lambda comm, token, x: ac.all_reduce(token, x, pair_of(comm.rank, comm.world_size), comm),
        lambda xs: [xs[r - r % 2] + xs[r - r % 2 + 1] for r in range(len(xs))],
    ),
    Case(
        "all_gather",
        lambda comm, token, x: ac.all_gather(token, x, 1, world(comm.world_size), comm),
        lambda xs: [torch.cat(xs, 1)] * len(xs),
    ),
    Case(
        "reduce_scatter",
        lambda comm, token, x: ac.reduce_scatter(token, x, 0, world(comm.world_size), comm),
        lambda xs: list(sum(xs).chunk(len(xs), 0)),
    ),
    Case(
        "all_to_all",
        lambda comm, token, x: ac.all_to_all(token, x, 0, 1, world(comm.world_size), comm),
        lambda xs: [torch.cat([x.chunk(len(xs), 0)[r] for x in xs], 1) for r in range(len(xs))],
    ),
    Case(
        "broadcast",
        lambda comm, token, x: ac.broadcast(
            token, x if comm.rank == 1 else None, 1, world(comm.world_size), SHAPE, torch.float64, comm
        ),
        lambda xs: [xs[1]] * len(xs),
    ),
    Case("ring_send_recv", lambda comm, token, x: ring_step(comm, token, x), lambda xs: [xs[r - 1] for r in range(len(xs))]),
]


def ring_step(comm, token, x):
    """Send x to the right neighbour, receive the left one's."""
    token = ac.send(token, x, (comm.rank + 1) % comm.world_size, 4, comm)
    return ac.recv(token, SHAPE, torch.float64, (comm.rank - 1) % comm.world_size, 4, comm)


def reference_gradients(reference: Callable, world_size: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    xs = [rank_input(rank).requires_grad_(True) for rank in range(world_size)]
    ys = reference(xs)
    sum((y * rank_weight(rank, y.shape)).sum() for rank, y in enumerate(ys)).backward()
    return [y.detach() for y in ys], [x.grad if x.grad is not None else torch.zeros(SHAPE, dtype=torch.float64) for x in xs]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_values_and_gradients_match_the_single_process_reference(case, world_size):
    def program(comm):
        x = rank_input(comm.rank).requires_grad_(True)
        y, token = case.program(comm, ac.new_token(), x)
        ac.backward(token, [(y * rank_weight(comm.rank, y.shape)).sum()])
        comm.wait_sends()
        return y.detach(), x.grad if x.grad is not None else torch.zeros(SHAPE, dtype=torch.float64)

    results = run_ranks(world_size, program, timeout=10)
    expected_outputs, expected_gradients = reference_gradients(case.reference, world_size)
    for rank, (output, gradient) in enumerate(results):
        torch.testing.assert_close(output, expected_outputs[rank], msg=f"output of rank {rank}")
        torch.testing.assert_close(gradient, expected_gradients[rank], msg=f"gradient of rank {rank}")


def mixed_program(comm, x, weight):
    """Ring p2p, every collective, an int64 index message and local compute in between; returns (loss, token)."""
    n, rank = comm.world_size, comm.rank
    everyone = world(n)
    right, left = (rank + 1) % n, (rank - 1) % n
    token = ac.new_token()
    gathered, token = ac.all_gather(token, x * (rank + 1), 0, everyone, comm)  # (4n, 6)
    token = ac.send(token, 2 * gathered[:4] + x * (rank + 1), right, 1, comm)
    token = ac.send(token, torch.arange(6).flip(0) if rank % 2 else torch.arange(6), right, 2, comm)
    received, token = ac.recv(token, SHAPE, torch.float64, left, 1, comm)  # (4, 6)
    permutation, token = ac.recv(token, (6,), torch.int64, left, 2, comm)
    mixed = received[:, permutation] * gathered.sum(0)  # (4, 6)
    exchanged, token = ac.all_to_all(token, mixed, 0, 1, everyone, comm)  # (4/n, 6n)
    summed, token = ac.all_reduce(token, exchanged.square(), everyone, comm)
    scattered, token = ac.reduce_scatter(token, summed.tanh(), 1, everyone, comm)  # (4/n, 6)
    broadcast, token = ac.broadcast(token, scattered if rank == 0 else None, 0, everyone, scattered.shape, scattered.dtype, comm)
    return (broadcast * weight).sum() + scattered.sin().sum(), token


def mixed_reference(xs, weights):
    """``mixed_program`` of every rank computed in one process: the sum of all ranks' losses."""
    n = len(xs)
    hs = [x * (rank + 1) for rank, x in enumerate(xs)]
    gathered = torch.cat(hs, 0)
    permutations = [torch.arange(6).flip(0) if rank % 2 else torch.arange(6) for rank in range(n)]
    mixed = [(2 * gathered[:4] + hs[rank - 1])[:, permutations[rank - 1]] * gathered.sum(0) for rank in range(n)]
    exchanged = [torch.cat([m.chunk(n, 0)[rank] for m in mixed], 1) for rank in range(n)]
    summed = sum(e.square() for e in exchanged)
    scattered = (n * summed.tanh()).chunk(n, 1)  # every rank reduce-scatters the same summed.tanh()
    return sum((scattered[0] * weights[rank]).sum() + scattered[rank].sin().sum() for rank in range(n))


@pytest.mark.parametrize("world_size", [2, 4])
def test_chain_of_p2p_and_collectives_runs_forward_and_backward_like_the_reference(world_size):
    weights = [rank_weight(rank, (4 // world_size, 6)) for rank in range(world_size)]

    def program(comm):
        x = rank_input(comm.rank).requires_grad_(True)
        loss, token = mixed_program(comm, x, weights[comm.rank])
        ac.backward(token, [loss])
        comm.wait_sends()
        return loss.detach(), x.grad

    results = run_ranks(world_size, program, timeout=10)
    xs = [rank_input(rank).requires_grad_(True) for rank in range(world_size)]
    total = mixed_reference(xs, weights)
    total.backward()
    torch.testing.assert_close(sum(loss for loss, _ in results), total.detach())
    for rank, (_, gradient) in enumerate(results):
        torch.testing.assert_close(gradient, xs[rank].grad, msg=f"gradient of rank {rank}")


def test_a_pipeline_propagates_gradients_through_ranks_without_a_loss():
    def program(comm):
        token = ac.new_token()
        x = rank_input(0).requires_grad_(True)
        if comm.rank == 0:
            hidden = x * 2
        else:
            hidden, token = ac.recv(token, SHAPE, torch.float64, comm.rank - 1, 0, comm)
        hidden = hidden.tanh() + comm.rank
        if comm.rank < comm.world_size - 1:
            token = ac.send(token, hidden, comm.rank + 1, 0, comm)
            ac.backward(token)  # no loss here: the token alone reaches the send, whose backward receives
        else:
            ac.backward(token, [hidden.square().sum()])
        comm.wait_sends()
        return x.grad

    x = rank_input(0).requires_grad_(True)
    hidden = (x * 2).tanh()
    for rank in range(1, 4):
        hidden = hidden.tanh() + rank
    hidden.square().sum().backward()
    torch.testing.assert_close(run_ranks(4, program, timeout=10)[0], x.grad)


class Recording:
    """A communicator that logs each call's method name, then delegates."""

    def __init__(self, comm):
        self.comm, self.rank, self.world_size, self.log = comm, comm.rank, comm.world_size, []

    def __getattr__(self, name):
        method = getattr(self.comm, name)

        def call(*args, **kwargs):
            self.log.append(name)
            return method(*args, **kwargs)

        return call


ADJOINT = {"send": "recv", "recv": "send", "all_reduce": "all_reduce", "all_gather": "reduce_scatter",
           "reduce_scatter": "all_gather", "all_to_all": "all_to_all", "broadcast": "all_reduce"}


def test_backward_replays_each_ranks_communication_in_reverse_order():
    def program(comm):
        comm = Recording(comm)
        everyone, peer = (0, 1), 1 - comm.rank
        first, second = (rank_input(comm.rank + 2 * k).requires_grad_(True) for k in range(2))
        token = ac.new_token()
        # Independent branches: without the token chain autograd could run their backwards in either order.
        summed, token = ac.all_reduce(token, first, everyone, comm)
        gathered, token = ac.all_gather(token, second, 0, everyone, comm)
        token = ac.send(token, second * 3, peer, 0, comm)
        received, token = ac.recv(token, SHAPE, torch.float64, peer, 0, comm)
        scattered, token = ac.reduce_scatter(token, gathered, 0, everyone, comm)
        forward = list(comm.log)
        ac.backward(token, [summed.sum() + received.sum() + scattered.sum()])
        return forward, comm.log[len(forward):]

    for forward, backward in run_ranks(2, program, timeout=10):
        assert backward == [ADJOINT[name] for name in reversed(forward)]


def test_integer_and_bool_tensors_pass_through_without_gradients_or_backward_messages():
    def program(comm):
        comm = Recording(comm)
        peer = 1 - comm.rank
        token = ac.new_token()
        token = ac.send(token, torch.tensor([2, 0, 1]), peer, 0, comm)
        token = ac.send(token, torch.tensor([True, False]), peer, 1, comm)
        indices, token = ac.recv(token, (3,), torch.int64, peer, 0, comm)
        mask, token = ac.recv(token, (2,), torch.bool, peer, 1, comm)
        counts, token = ac.all_reduce(token, indices, (0, 1), comm)
        forward = len(comm.log)
        ac.backward(token)
        assert not (indices.requires_grad or mask.requires_grad or counts.requires_grad)
        return indices, mask, counts, comm.log[forward:]

    for indices, mask, counts, backward_calls in run_ranks(2, program, timeout=10):
        assert indices.dtype == torch.int64 and indices.tolist() == [2, 0, 1]
        assert mask.tolist() == [True, False] and counts.tolist() == [4, 0, 2]
        assert backward_calls == []


def test_a_float_tensor_without_grad_still_receives_its_gradient_message():
    def program(comm):
        comm = Recording(comm)
        token = ac.new_token()
        if comm.rank == 0:
            token = ac.send(token, torch.ones(3, dtype=torch.float64), 1, 0, comm)  # data: no requires_grad
            ac.backward(token)
        else:
            received, token = ac.recv(token, (3,), torch.float64, 0, 0, comm)
            ac.backward(token, [received.sum()])
        comm.wait_sends()
        return comm.log

    sender_log, receiver_log = run_ranks(2, program, timeout=10)
    assert sender_log == ["send", "recv", "wait_sends"] and receiver_log == ["recv", "send", "wait_sends"]


def test_each_op_returns_a_new_token_whose_gradient_is_zero():
    def program(comm):
        start = ac.new_token()
        x = torch.ones(2, requires_grad=True)
        summed, token = ac.all_reduce(start, x, (0, 1), comm)
        next_token = ac.send(token, summed, 1 - comm.rank, 0, comm)
        _, last = ac.recv(next_token, (2,), torch.float32, 1 - comm.rank, 0, comm)
        ac.backward(last, [summed.sum()])
        comm.wait_sends()
        return start, token, next_token, last

    for start, *tokens in run_ranks(2, program, timeout=10):
        assert len({id(token) for token in [start, *tokens]}) == 4
        assert all(token.grad_fn is not None and token.shape == () for token in tokens)
        assert torch.equal(start.grad, torch.zeros(()))


def test_a_rank_failing_before_backward_makes_the_others_raise_instead_of_hang():
    def program(comm):
        x = rank_input(comm.rank).requires_grad_(True)
        y, token = ring_step(comm, ac.new_token(), x)
        if comm.rank == 2:
            raise RuntimeError("rank 2 lost its loss")
        ac.backward(token, [y.sum()])  # blocks in the send's backward recv from the right neighbour

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 2 lost its loss"):
        run_ranks(4, program, timeout=30)
    assert time.monotonic() - start < 2.0


def test_a_missing_gradient_message_times_out_with_the_backward_tag():
    def program(comm):
        token = ac.send(ac.new_token(), torch.ones(2, requires_grad=True), 1 - comm.rank, 5, comm)
        if comm.rank == 0:
            ac.backward(token)  # rank 1 never runs backward, so no gradient arrives
        else:
            time.sleep(1.0)

    with pytest.raises(CommunicationError, match=f"recv from rank 1 with tag {5 + BACKWARD_TAG_OFFSET} did not complete"):
        run_ranks(2, program, timeout=0.3)
