"""An in-process world: N virtual ranks as threads, so every rank's generated code runs on one machine.

``verify`` proves 8-32-rank plans this way. The world holds:

- mailboxes keyed by ``(src, dst, tag)``: FIFO queues of cloned tensors; ``send`` deposits and
  returns, ``recv`` blocks until one arrives. Between two ranks, the k-th recv must take the k-th
  message sent, whatever the tags: NCCL matches point-to-point messages by issue order and ignores
  tags (gloo matches tags), so a program that passes here is correct on both backends.
- rendezvous slots keyed by ``(channel, ranks, sequence number)``: each rank's n-th collective over
  a ``ranks`` tuple meets the other ranks' n-th one. Blocking collectives use one channel and
  ``all_reduce_async`` another, with sequences of their own (as the torch communicator uses
  separate process groups). An async sum deposits when it starts and returns at once; its
  ``wait()`` collects the deposits, so starting one never blocks. Every rank deposits a clone of its tensor, and
  once all have, each computes its own result from the deposits *in ranks order*, so sums are
  added in the same order everywhere and the results are bit-identical across ranks.

No tensor is shared between ranks (deposits are clones, results are fresh tensors). A rank that
fails marks the world failed, which wakes every waiting rank with ``CommunicationError``; together
with the timeout on every wait, nothing hangs.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence, TypeVar

import torch

from lightning_nnscaler.runtime.comm import (
    CommunicationError,
    check_broadcast_source,
    check_divisible,
    check_in_place,
    check_peer,
    check_ranks,
)

Result = TypeVar("Result")


@dataclass
class _Rendezvous:
    """One collective call: what it is (must agree on every rank) and each rank's deposit."""

    signature: str
    deposits: dict[int, torch.Tensor | None] = field(default_factory=dict)
    taken: int = 0


class InMemoryWorld:
    """The shared state of ``world_size`` virtual ranks; each thread talks through an ``InMemoryCommunicator``.

    Args:
        world_size: number of virtual ranks.
        timeout: seconds any wait may take before it raises ``CommunicationError``.
    """

    def __init__(self, world_size: int, timeout: float) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self.failure: tuple[int, BaseException] | None = None
        self._condition = threading.Condition()
        self._mailboxes: dict[tuple[int, int, int], deque[tuple[int, torch.Tensor]]] = defaultdict(deque)
        self._sent: dict[tuple[int, int], int] = defaultdict(int)  # messages sent from src to dst so far
        self._received: dict[tuple[int, int], int] = defaultdict(int)
        self._rendezvous: dict[tuple[str, tuple[int, ...], int], _Rendezvous] = {}

    def fail(self, rank: int, error: BaseException) -> None:
        """Record the first failure and wake every waiting rank, whose waits then raise."""
        with self._condition:
            if self.failure is None:
                self.failure = (rank, error)
            self._condition.notify_all()

    def post(self, src: int, dst: int, tag: int, tensor: torch.Tensor) -> None:
        with self._condition:
            self._mailboxes[(src, dst, tag)].append((self._sent[(src, dst)], tensor))
            self._sent[(src, dst)] += 1
            self._condition.notify_all()

    def check_all_received(self) -> None:
        """Raise ``CommunicationError`` naming a message that was sent but never received: on real
        processes its send would never complete (a hang at ``wait_sends``)."""
        left = sorted(key for key, messages in self._mailboxes.items() if messages)
        if left:
            src, dst, tag = left[0]
            raise CommunicationError(
                f"rank {src} sent rank {dst} a message with tag {tag} that rank {dst} never received "
                f"({len(left)} such message kinds): on real processes rank {src} would wait for it forever"
            )

    def take(self, src: int, dst: int, tag: int) -> torch.Tensor:
        key, description = (src, dst, tag), f"rank {dst}: recv from rank {src} with tag {tag}"
        with self._condition:
            self._wait_for(lambda: bool(self._mailboxes[key]), description)
            index, tensor = self._mailboxes[key].popleft()
            expected = self._received[(src, dst)]
            if index != expected:
                error = CommunicationError(
                    f"{description} got message #{index} rank {src} sent to it, but #{expected} was sent earlier and "
                    "is not received yet: NCCL matches send/recv between two ranks in issue order (it ignores "
                    "tags), so receive messages in the order they were sent"
                )
                self.failure = self.failure or (dst, error)
                self._condition.notify_all()
                raise error
            self._received[(src, dst)] += 1
            return tensor

    def exchange(
        self, rank: int, ranks: tuple[int, ...], sequence: int, signature: str, tensor: torch.Tensor | None, channel: str = ""
    ) -> list[torch.Tensor | None]:
        """Deposit ``tensor`` in collective number ``sequence`` over ``ranks``; return all deposits in ranks order."""
        self.deposit(rank, ranks, sequence, signature, tensor, channel)
        return self.collect(rank, ranks, sequence, signature, channel)

    def deposit(
        self, rank: int, ranks: tuple[int, ...], sequence: int, signature: str, tensor: torch.Tensor | None, channel: str = ""
    ) -> None:
        """Deposit ``tensor`` in collective number ``sequence`` over ``ranks`` on ``channel``; never blocks."""
        key = (channel, ranks, sequence)
        with self._condition:
            if self.failure is not None:
                failed_rank, error = self.failure
                raise CommunicationError(
                    f"rank {rank}: {signature} over ranks {ranks} aborted: rank {failed_rank} failed with {error!r}"
                )
            slot = self._rendezvous.setdefault(key, _Rendezvous(signature))
            if slot.signature != signature:
                error = CommunicationError(
                    f"rank {rank} called {signature} but another rank called {slot.signature} "
                    f"as {channel + ' ' if channel else ''}collective #{sequence} over ranks {ranks}: "
                    "ranks disagree on the collective order"
                )
                self.failure = self.failure or (rank, error)
                self._condition.notify_all()
                raise error
            slot.deposits[rank] = tensor
            self._condition.notify_all()

    def collect(
        self, rank: int, ranks: tuple[int, ...], sequence: int, signature: str, channel: str = ""
    ) -> list[torch.Tensor | None]:
        """Wait until every rank deposited in collective ``sequence``; return the deposits in ranks order."""
        key = (channel, ranks, sequence)
        description = f"rank {rank}: {signature} over ranks {ranks} ({channel + ' ' if channel else ''}collective #{sequence} on them)"
        with self._condition:
            slot = self._rendezvous[key]
            self._wait_for(lambda: len(slot.deposits) == len(ranks), description)
            slot.taken += 1
            if slot.taken == len(ranks):
                del self._rendezvous[key]
            return [slot.deposits[member] for member in ranks]

    def _wait_for(self, ready: Callable[[], bool], description: str) -> None:
        """Wait (holding the condition) until ``ready()``; raise if the world failed or the timeout passed."""
        deadline = time.monotonic() + self.timeout
        while not ready():
            if self.failure is not None:
                failed_rank, error = self.failure
                raise CommunicationError(f"{description} aborted: rank {failed_rank} failed with {error!r}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CommunicationError(f"{description} did not complete within {self.timeout} s")
            self._condition.wait(remaining)


class InMemoryCommunicator:
    """The ``Communicator`` of one virtual rank of an ``InMemoryWorld``."""

    def __init__(self, world: InMemoryWorld, rank: int) -> None:
        if not 0 <= rank < world.world_size:
            raise ValueError(f"rank {rank} is not in [0, {world.world_size})")
        self.world = world
        self.rank = rank
        self.world_size = world.world_size
        self.timeout = world.timeout
        self._sequence: dict[tuple[int, ...], int] = defaultdict(int)
        self._async_sequence: dict[tuple[int, ...], int] = defaultdict(int)

    def create_groups(self, all_rank_tuples: Iterable[Sequence[int]]) -> None:
        """Nothing to create in memory; only checks that each tuple names ranks of this world."""
        for ranks in all_rank_tuples:
            ranks = tuple(sorted(ranks))
            if ranks and (ranks[0] < 0 or ranks[-1] >= self.world_size):
                raise ValueError(f"ranks {ranks} are not all in [0, {self.world_size})")

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        check_peer(dst, self.rank, self.world_size)
        self.world.post(self.rank, dst, tag, tensor.detach().clone())

    def recv(self, shape: Sequence[int], dtype: torch.dtype, src: int, tag: int) -> torch.Tensor:
        check_peer(src, self.rank, self.world_size)
        tensor = self.world.take(src, self.rank, tag)
        if tensor.shape != tuple(shape) or tensor.dtype != dtype:
            raise CommunicationError(
                f"rank {self.rank}: recv from rank {src} with tag {tag} expected {tuple(shape)} {dtype}, "
                f"got {tuple(tensor.shape)} {tensor.dtype}: sender and receiver disagree on the message"
            )
        return tensor

    def post_recv(self, shape: Sequence[int], dtype: torch.dtype, src: int, tag: int) -> None:
        """A message waits in the world for its receiver: posting ahead gains nothing here."""

    def wait_sends(self) -> None:
        """Sends are buffered in the world when issued, so there is nothing to wait for."""

    def release_send(self, dst: int, tag: int) -> None:
        """The world hands a message to its receiver and keeps no copy: nothing to release."""

    def all_reduce(self, tensor: torch.Tensor, ranks: tuple[int, ...]) -> torch.Tensor:
        return _sum_in_order(self._exchange(ranks, "all_reduce", tensor))

    def all_reduce_async(self, tensor: torch.Tensor, ranks: tuple[int, ...], *, in_place: bool = False) -> "_InMemoryHandle":
        """Deposit now (never blocks); the handle's ``wait()`` waits for the other ranks and sums in ranks order
        (into ``tensor`` itself when ``in_place``)."""
        ranks = check_ranks(ranks, self.rank, self.world_size)
        target = check_in_place(tensor) if in_place else None
        sequence = self._async_sequence[ranks]
        self._async_sequence[ranks] += 1
        deposit = tensor.detach().clone(memory_format=torch.contiguous_format)
        signature = f"all_reduce_async({tuple(deposit.shape)}, {deposit.dtype})"
        self.world.deposit(self.rank, ranks, sequence, signature, deposit, _ASYNC_CHANNEL)
        return _InMemoryHandle(self.world, self.rank, ranks, sequence, signature, target)

    def all_gather(self, tensor: torch.Tensor, dim: int, ranks: tuple[int, ...]) -> torch.Tensor:
        return torch.cat(self._exchange(ranks, f"all_gather(dim={dim})", tensor), dim)

    def reduce_scatter(self, tensor: torch.Tensor, dim: int, ranks: tuple[int, ...]) -> torch.Tensor:
        check_divisible(tensor, dim, len(ranks), "reduce_scatter")
        deposits = self._exchange(ranks, f"reduce_scatter(dim={dim})", tensor)
        index = ranks.index(self.rank)
        return _sum_in_order([deposit.chunk(len(ranks), dim)[index] for deposit in deposits])

    def all_to_all(self, tensor: torch.Tensor, split_dim: int, concat_dim: int, ranks: tuple[int, ...]) -> torch.Tensor:
        check_divisible(tensor, split_dim, len(ranks), "all_to_all")
        deposits = self._exchange(ranks, f"all_to_all(split_dim={split_dim}, concat_dim={concat_dim})", tensor)
        index = ranks.index(self.rank)
        return torch.cat([deposit.chunk(len(ranks), split_dim)[index] for deposit in deposits], concat_dim)

    def broadcast(
        self, tensor: torch.Tensor | None, src: int, ranks: tuple[int, ...], shape: Sequence[int], dtype: torch.dtype
    ) -> torch.Tensor:
        if src not in check_ranks(ranks, self.rank, self.world_size):
            raise ValueError(f"broadcast source rank {src} is not in ranks {ranks}")
        if self.rank == src:
            check_broadcast_source(tensor, src, shape, dtype)
        deposits = self._exchange(ranks, f"broadcast(src={src})", tensor if self.rank == src else None)
        result = deposits[ranks.index(src)].clone()
        if result.shape != tuple(shape) or result.dtype != dtype:
            raise CommunicationError(
                f"rank {self.rank}: broadcast from rank {src} expected {tuple(shape)} {dtype}, "
                f"got {tuple(result.shape)} {result.dtype}"
            )
        return result

    def barrier(self) -> None:
        self._exchange(tuple(range(self.world_size)), "barrier", None)

    def _exchange(self, ranks: tuple[int, ...], signature: str, tensor: torch.Tensor | None) -> list:
        ranks = check_ranks(ranks, self.rank, self.world_size)
        sequence = self._sequence[ranks]
        self._sequence[ranks] += 1
        deposit = None if tensor is None else tensor.detach().clone(memory_format=torch.contiguous_format)
        return self.world.exchange(self.rank, ranks, sequence, signature, deposit)


_ASYNC_CHANNEL = "async"


class _InMemoryHandle:
    """An ``all_reduce_async`` whose deposit is in the world; ``wait`` collects and sums (once)."""

    def __init__(
        self, world: InMemoryWorld, rank: int, ranks: tuple[int, ...], sequence: int, signature: str, target: torch.Tensor | None
    ) -> None:
        self._world, self._rank, self._ranks, self._sequence, self._signature = world, rank, ranks, sequence, signature
        self._target = target  # in place: the caller's tensor receives the sum
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            deposits = self._world.collect(self._rank, self._ranks, self._sequence, self._signature, _ASYNC_CHANNEL)
            summed = _sum_in_order(deposits)
            self._result = summed if self._target is None else self._target.copy_(summed)
        return self._result


def _sum_in_order(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Left-to-right sum into a fresh tensor: the same order on every rank, so bit-identical results."""
    total = tensors[0].clone(memory_format=torch.contiguous_format)
    for tensor in tensors[1:]:
        total += tensor
    return total


def run_ranks(world_size: int, fn: Callable[[InMemoryCommunicator], Result], timeout: float = 60.0) -> list[Result]:
    """Run ``fn(communicator)`` for every rank of a fresh world on its own thread; return results by rank.

    Raises:
        BaseException: the first exception any rank raised (a note names the rank); the other ranks
            were woken by the failure, so this returns within the timeout.
    """
    world = InMemoryWorld(world_size, timeout)
    results: list = [None] * world_size

    def run(rank: int) -> None:
        try:
            results[rank] = fn(InMemoryCommunicator(world, rank))
        except BaseException as error:  # re-raised in the caller's thread below
            world.fail(rank, error)

    threads = [threading.Thread(target=run, args=(rank,), name=f"rank{rank}", daemon=True) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if world.failure is not None:
        rank, error = world.failure
        if sys.version_info >= (3, 11):
            error.add_note(f"raised on rank {rank} of {world_size} (in-memory world)")
        raise error
    world.check_all_received()
    return results
