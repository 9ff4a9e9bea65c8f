"""``runtime.logged_comm.LoggedCommunicator`` on real gloo ranks: what it records matches across ranks into durations."""

from __future__ import annotations

import time

import torch

from support.ranks import launch_ranks

from lightning_nnscaler.runtime.logged_comm import Event, LoggedCommunicator
from lightning_nnscaler.sim.in_step import in_step_durations


def logged_rank(rank: int, world_size: int) -> list[Event]:
    """A message the receiver waits for, a blocking sum, a gather and an asynchronous sum waited on."""
    communicator = LoggedCommunicator(30.0)
    communicator.create_groups([(0, 1)])
    communicator.all_reduce(torch.ones(1), (0, 1))  # gloo connects on first use: not what is timed here
    communicator.events = []
    if rank == 0:
        time.sleep(0.02)  # rank 1 is already waiting in its receive
        communicator.send(torch.ones(16), 1, tag=3)
        communicator.wait_sends()
    else:
        communicator.recv((16,), torch.float32, 0, tag=3)
    communicator.all_reduce(torch.ones(8), (0, 1))
    communicator.all_gather(torch.ones(4), 0, (0, 1))
    if rank == 0:
        time.sleep(0.2)  # rank 1 blocks in its wait until rank 0 joins the sum (0.02 s was not always enough on a loaded machine)
    handle = communicator.all_reduce_async(torch.ones(32), (0, 1))
    assert torch.equal(handle.wait(), torch.full((32,), 2.0))
    return communicator.events


def test_logged_gloo_operations_become_in_step_durations() -> None:
    events = launch_ranks(logged_rank, 2, timeout=60.0)
    assert [event.kind for event in events[0]] == ["send", "all_reduce", "all_gather", "all_reduce"]
    assert [event.kind for event in events[1]] == ["recv", "all_reduce", "all_gather", "all_reduce"]
    send = events[0][0]
    assert send.issued <= send.issue_returned and send.returned is None  # a send's call returns; its transfer goes on
    durations = in_step_durations(events)
    assert set(durations) == {("p2p", 2), ("all_reduce", 2), ("all_gather", 2)}
    assert [nbytes for nbytes, _ in durations["p2p", 2]] == [64]
    assert sorted(nbytes for nbytes, _ in durations["all_reduce", 2]) == [32, 128]  # the async sum: rank 1 blocked in it
    assert all(seconds >= 0 for points in durations.values() for _, seconds in points)
    # the async sum is timed from rank 0's late arrival, not from rank 1's issue 200 ms before it
    assert dict(durations["all_reduce", 2])[128] < 0.02


def late_receiving_rank(rank: int, world_size: int) -> list[Event]:
    """Rank 0 sends, then both meet in a sum: rank 1 posts its receive surely after the send returned."""
    communicator = LoggedCommunicator(30.0)
    communicator.create_groups([(0, 1)])
    communicator.all_reduce(torch.ones(1), (0, 1))  # connect first
    communicator.events = []
    if rank == 0:
        communicator.send(torch.ones(16), 1, tag=5)
        communicator.all_reduce(torch.ones(1), (0, 1))
        communicator.wait_sends()
    else:
        communicator.all_reduce(torch.ones(1), (0, 1))
        time.sleep(0.2)
        communicator.recv((16,), torch.float32, 0, tag=5)
    return [event for event in communicator.events if event.kind in ("send", "recv")]


def test_a_receive_posted_after_its_send_is_a_late_receive_timed_from_its_own_call() -> None:
    events = launch_ranks(late_receiving_rank, 2, timeout=60.0)
    durations = in_step_durations(events)
    assert set(durations) == {("late_recv", 2)}  # not a one-way message time: the receiver was not waiting
    ((nbytes, seconds),) = durations["late_recv", 2]
    assert nbytes == 64 and 0 <= seconds < 0.2  # its own call, not the 200 ms rank 1 slept before it
