"""InMemoryCommunicator: each op's values on 2 and 4 thread ranks, and that failures raise instead of hang."""

from __future__ import annotations

import time

import pytest
import torch

from lightning_nnscaler.runtime import CommunicationError, Communicator, InMemoryCommunicator, InMemoryWorld, run_ranks

pytestmark = pytest.mark.timeout(60)


def rank_tensor(rank: int, shape: tuple[int, ...] = (4, 6)) -> torch.Tensor:
    """A distinct, reproducible tensor per rank."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 + rank))


def test_communicator_satisfies_the_protocol():
    assert isinstance(InMemoryCommunicator(InMemoryWorld(2, 1.0), 1), Communicator)


@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_over_the_whole_world(world_size):
    world = tuple(range(world_size))
    inputs = [rank_tensor(rank) for rank in world]  # (4, 6)
    split_dim = 0  # 4 rows split into 2 or 4 equal chunks

    def program(comm):
        x = inputs[comm.rank]
        return {
            "all_reduce": comm.all_reduce(x, world),
            "all_gather": comm.all_gather(x, 1, world),
            "reduce_scatter": comm.reduce_scatter(x, split_dim, world),
            "all_to_all": comm.all_to_all(x, split_dim, 1, world),
            "broadcast": comm.broadcast(x if comm.rank == 1 else None, 1, world, x.shape, x.dtype),
        }

    results = run_ranks(world_size, program, timeout=10)
    total = sum(inputs[1:], inputs[0].clone())
    for rank, result in enumerate(results):
        assert torch.equal(result["all_reduce"], total)
        assert torch.equal(result["all_gather"], torch.cat(inputs, 1))
        assert torch.equal(result["reduce_scatter"], total.chunk(world_size, split_dim)[rank])
        expected = torch.cat([x.chunk(world_size, split_dim)[rank] for x in inputs], 1)
        assert torch.equal(result["all_to_all"], expected)
        assert torch.equal(result["broadcast"], inputs[1])


def test_collectives_over_disjoint_subgroups_run_independently():
    def program(comm):
        pair = (0, 2) if comm.rank % 2 == 0 else (1, 3)
        x = torch.tensor([float(comm.rank)])
        return comm.all_reduce(x, pair), comm.all_gather(x, 0, pair), comm.all_reduce(x, (0, 1, 2, 3))

    results = run_ranks(4, program, timeout=10)
    assert [float(result[0]) for result in results] == [2.0, 4.0, 2.0, 4.0]
    assert [result[1].tolist() for result in results] == [[0.0, 2.0], [1.0, 3.0], [0.0, 2.0], [1.0, 3.0]]
    assert all(float(result[2]) == 6.0 for result in results)


def test_sums_add_in_ranks_order_and_are_bit_identical_across_ranks():
    # Magnitudes that make float32 addition order visible.
    inputs = [rank_tensor(rank, (64,)) * 10.0 ** (3 * (rank % 3)) for rank in range(4)]

    def program(comm):
        return comm.all_reduce(inputs[comm.rank], (0, 1, 2, 3))

    results = run_ranks(4, program, timeout=10)
    in_order = ((inputs[0] + inputs[1]) + inputs[2]) + inputs[3]
    assert all(torch.equal(result, in_order) for result in results)


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_of_sends_and_receives(world_size):
    def program(comm):
        right, left = (comm.rank + 1) % comm.world_size, (comm.rank - 1) % comm.world_size
        comm.send(rank_tensor(comm.rank), right, tag=3)
        received = comm.recv((4, 6), torch.float32, left, tag=3)
        comm.wait_sends()
        comm.barrier()
        return received

    results = run_ranks(world_size, program, timeout=10)
    for rank, received in enumerate(results):
        assert torch.equal(received, rank_tensor((rank - 1) % world_size))


def test_messages_with_one_tag_arrive_in_the_order_sent():
    def program(comm):
        if comm.rank == 0:
            for value in (1.0, 2.0, 3.0):
                comm.send(torch.tensor([value]), 1, tag=7)
            return None
        return [float(comm.recv((1,), torch.float32, 0, tag=7)) for _ in range(3)]

    assert run_ranks(2, program, timeout=10)[1] == [1.0, 2.0, 3.0]


def test_receiving_in_another_order_than_sent_raises_because_nccl_matches_by_order():
    def program(comm):
        if comm.rank == 0:
            comm.send(torch.tensor([1.0]), 1, tag=7)
            comm.send(torch.tensor([2.0]), 1, tag=8)
        else:
            comm.recv((1,), torch.float32, 0, tag=8)

    with pytest.raises(CommunicationError, match=r"tag 8 got message #1 .* but #0 was sent earlier .* NCCL"):
        run_ranks(2, program, timeout=10)


def test_no_tensor_is_shared_between_ranks():
    def program(comm):
        x = torch.ones(3)
        if comm.rank == 0:
            comm.send(x, 1, tag=0)
            x.add_(100.0)  # after the send: the receiver must still see ones
        received = comm.recv((3,), torch.float32, 0, tag=0) if comm.rank == 1 else x
        broadcast = comm.broadcast(x if comm.rank == 0 else None, 0, (0, 1), (3,), torch.float32)
        broadcast.add_(comm.rank)  # each rank owns its result
        return received, broadcast, x

    (_, broadcast0, x0), (received1, broadcast1, _) = run_ranks(2, program, timeout=10)
    assert torch.equal(received1, torch.ones(3))
    assert torch.equal(broadcast0, torch.full((3,), 101.0)) and torch.equal(broadcast1, torch.full((3,), 102.0))
    assert torch.equal(x0, torch.full((3,), 101.0))


def test_recv_without_a_sender_times_out_naming_op_peer_tag_and_timeout():
    world = InMemoryWorld(2, timeout=0.3)
    start = time.monotonic()
    with pytest.raises(CommunicationError, match=r"rank 1: recv from rank 0 with tag 9 did not complete within 0.3 s"):
        InMemoryCommunicator(world, 1).recv((2,), torch.float32, 0, tag=9)
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize("blocked_in", ["recv", "all_reduce", "subgroup"])
def test_a_failing_rank_wakes_the_others_instead_of_letting_them_hang(blocked_in):
    def program(comm):
        if comm.rank == 0:
            time.sleep(0.1)  # let the others block first
            raise ZeroDivisionError("rank 0 broke")
        if blocked_in == "recv":
            comm.recv((2,), torch.float32, 0, tag=1)
        elif blocked_in == "all_reduce":
            comm.all_reduce(torch.ones(2), (0, 1, 2, 3))
        else:
            comm.all_reduce(torch.ones(2), (1, 2, 3))  # completes: rank 0 is not in it
            comm.barrier()

    start = time.monotonic()
    with pytest.raises(ZeroDivisionError, match="rank 0 broke") as caught:
        run_ranks(4, program, timeout=30)
    assert time.monotonic() - start < 2.0, "the blocked ranks waited for their timeout instead of being woken"
    assert "raised on rank 0 of 4" in "\n".join(caught.value.__notes__)


def test_ranks_that_disagree_on_the_collective_order_raise():
    def program(comm):
        x = torch.ones(2)
        return comm.all_reduce(x, (0, 1)) if comm.rank == 0 else comm.all_gather(x, 0, (0, 1))

    with pytest.raises(CommunicationError, match=r"called all_(reduce|gather).* but another rank called all_"):
        run_ranks(2, program, timeout=10)


def test_recv_of_a_different_shape_than_sent_raises():
    def program(comm):
        if comm.rank == 0:
            comm.send(torch.ones(2, 3), 1, tag=0)
        else:
            comm.recv((3, 2), torch.float32, 0, tag=0)

    with pytest.raises(CommunicationError, match=r"expected \(3, 2\) torch.float32, got \(2, 3\) torch.float32"):
        run_ranks(2, program, timeout=10)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda comm: comm.all_reduce(torch.ones(1), (1, 2)), r"contains rank 0"),
        (lambda comm: comm.all_reduce(torch.ones(1), (1, 0)), r"sorted tuple"),
        (lambda comm: comm.all_gather(torch.ones(1), 0, (0, 5)), r"in \[0, 4\)"),
        (lambda comm: comm.send(torch.ones(1), 0, 0), r"peer 0 of rank 0 must be another rank"),
        (lambda comm: comm.reduce_scatter(torch.ones(3), 0, (0, 1)), r"does not split into 2 equal chunks"),
        (lambda comm: comm.broadcast(None, 0, (0, 1), (1,), torch.float32), r"source rank 0 must pass a \(1,\) torch"),
        (lambda comm: comm.broadcast(torch.ones(2), 0, (0, 1), (1,), torch.float32), r"got \(2,\) torch.float32"),
    ],
)
def test_invalid_arguments_raise_before_communicating(call, message):
    with pytest.raises(ValueError, match=message):
        call(InMemoryCommunicator(InMemoryWorld(4, 0.5), 0))


def test_thirty_two_ranks():
    world = tuple(range(32))

    def program(comm):
        x = torch.full((32,), float(comm.rank))
        return comm.reduce_scatter(comm.all_gather(x, 0, world), 0, world)

    results = run_ranks(32, program, timeout=20)
    # all_gather then reduce_scatter: 32 copies of rank r's chunk of the gathered tensor (all r's).
    assert all(torch.equal(result, torch.full((32,), 32.0 * rank)) for rank, result in enumerate(results))
