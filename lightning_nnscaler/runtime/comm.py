"""The communicator that generated per-rank code calls, and its torch.distributed implementation.

Generated code sees only the ``Communicator`` protocol, so the same code runs over real processes
(``TorchDistributedCommunicator``: gloo on CPU, NCCL on CUDA) and over threads in one process
(``memory_comm.InMemoryCommunicator``, used by ``verify``).

Conventions shared by every implementation:

- ``ranks`` is a sorted tuple of *global* ranks that contains this rank; a rank's position in it is
  its chunk index (``all_gather`` concatenates in ``ranks`` order, ``reduce_scatter`` keeps chunk
  ``ranks.index(rank)``). Every rank in ``ranks`` passes a tensor of the same shape and dtype.
- Collectives return a new tensor and never modify their input.
- ``send`` copies the tensor and returns at once (the caller may modify it afterwards);
  ``wait_sends`` waits for every send issued so far, and ``release_send`` for one the peer is known to
  have received (its copy is held until then: gloo cannot tell a finished send without waiting for
  it). ``recv`` blocks.
- Point-to-point messages carry a tag that sender and receiver must agree on (gloo matches tags),
  *and* between two ranks they are received in the order they were sent (NCCL ignores tags and
  matches by order). The in-memory world enforces both.
- ``all_reduce_async`` starts a sum and returns at once; ``handle.wait()`` returns it. With
  ``in_place=True`` it is the one exception to "never modify the input": the sum is written into
  the (contiguous) tensor itself, which the caller leaves alone until ``wait`` (gradient buckets
  are summed without a copy). Async sums run
  on a channel of their own (separate process groups; a separate sequence in memory), so they never
  pair with a blocking collective, and a rank blocked in a blocking collective cannot deadlock with
  one that started async sums. Every rank of ``ranks`` must start its async sums over ``ranks`` in
  the same order (not necessarily at the same point relative to blocking collectives).
- Every wait is bounded by the communicator's timeout and raises ``CommunicationError`` naming the
  op, the peer or group, the tag and the timeout, so a dead or diverged peer fails instead of hangs.
  After a ``CommunicationError`` the communicator is unusable (gloo closes the pair on a timeout).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Callable, Iterable, Protocol, Sequence, runtime_checkable

import torch
import torch.distributed as dist

from lightning_nnscaler.ir.errors import NnScalerError
from lightning_nnscaler.runtime.groups import GroupCache, MissingGroupError


class CommunicationError(NnScalerError, RuntimeError):
    """A communication failed or did not complete within the timeout; the message names op, peer and tag."""


@runtime_checkable
class Communicator(Protocol):
    """What generated per-rank code calls; see the module docstring for the shared conventions."""

    rank: int
    world_size: int

    def create_groups(self, all_rank_tuples: Iterable[Sequence[int]]) -> None:
        """Prepare every ``ranks`` tuple the program uses; call once at setup, with the same tuples on all ranks."""

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        """Start sending ``tensor`` to ``dst``; returns at once (see ``wait_sends``)."""

    def recv(self, shape: Sequence[int], dtype: torch.dtype, src: int, tag: int) -> torch.Tensor:
        """Block until the tensor sent by ``src`` with ``tag`` arrives."""

    def post_recv(self, shape: Sequence[int], dtype: torch.dtype, src: int, tag: int) -> None:
        """Start receiving the tensor ``src`` sends with ``tag`` now, where the backend gains from it; the matching
        ``recv`` then returns it. Generated code posts a receive where its message is sent (see ``TorchDistributedCommunicator``)."""

    def all_reduce(self, tensor: torch.Tensor, ranks: tuple[int, ...]) -> torch.Tensor:
        """Sum over ``ranks``."""

    def all_reduce_async(self, tensor: torch.Tensor, ranks: tuple[int, ...], *, in_place: bool = False) -> "AsyncHandle":
        """Start a sum over ``ranks`` without blocking; ``handle.wait()`` returns it (see the module docstring)."""

    def all_gather(self, tensor: torch.Tensor, dim: int, ranks: tuple[int, ...]) -> torch.Tensor:
        """Concatenate every rank's tensor along ``dim`` in ``ranks`` order."""

    def reduce_scatter(self, tensor: torch.Tensor, dim: int, ranks: tuple[int, ...]) -> torch.Tensor:
        """Sum over ``ranks``, then keep chunk ``ranks.index(rank)`` along ``dim``."""

    def all_to_all(self, tensor: torch.Tensor, split_dim: int, concat_dim: int, ranks: tuple[int, ...]) -> torch.Tensor:
        """Send chunk ``i`` along ``split_dim`` to ``ranks[i]``; concatenate what arrives along ``concat_dim``."""

    def broadcast(
        self, tensor: torch.Tensor | None, src: int, ranks: tuple[int, ...], shape: Sequence[int], dtype: torch.dtype
    ) -> torch.Tensor:
        """``src``'s tensor on every rank of ``ranks``; the others pass ``None``."""

    def wait_sends(self) -> None:
        """Wait until every send issued so far has completed."""

    def release_send(self, dst: int, tag: int) -> None:
        """The send to ``dst`` with ``tag`` is known received (``dst`` answered it): finish it and drop its copy.

        Call it only where the peer's receive is known to have been posted (a pipeline's message, once a message
        the peer sent after taking it arrived: the generated ``RELEASES`` table); otherwise it may wait for the peer."""

    def barrier(self) -> None:
        """Wait for every rank of the world."""


@runtime_checkable
class AsyncHandle(Protocol):
    """A started asynchronous collective."""

    def wait(self) -> torch.Tensor:
        """Block (within the communicator's timeout) until the collective completes; return its result."""


def check_ranks(ranks: tuple[int, ...], rank: int, world_size: int) -> tuple[int, ...]:
    """Return ``ranks`` as a tuple, or raise ValueError naming what is wrong with it."""
    ranks = tuple(ranks)
    if rank not in ranks or list(ranks) != sorted(set(ranks)) or ranks[0] < 0 or ranks[-1] >= world_size:
        raise ValueError(
            f"ranks {ranks} must be a sorted tuple of distinct ranks in [0, {world_size}) that contains rank {rank}"
        )
    return ranks


def check_in_place(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (detached) if an in-place collective can write into it; raise ValueError if it is not contiguous."""
    if not tensor.is_contiguous():
        raise ValueError(f"an in-place all_reduce_async needs a contiguous tensor, got strides {tensor.stride()}")
    return tensor.detach()


def check_peer(peer: int, rank: int, world_size: int) -> None:
    """Raise ValueError unless ``peer`` is another rank of the world."""
    if not 0 <= peer < world_size or peer == rank:
        raise ValueError(f"peer {peer} of rank {rank} must be another rank in [0, {world_size})")


def check_divisible(tensor: torch.Tensor, dim: int, parts: int, op: str) -> None:
    """Raise ValueError unless ``tensor`` splits into ``parts`` equal chunks along ``dim``."""
    if tensor.shape[dim] % parts:
        raise ValueError(f"{op}: dim {dim} of shape {tuple(tensor.shape)} does not split into {parts} equal chunks")


def check_broadcast_source(tensor: torch.Tensor | None, src: int, shape: Sequence[int], dtype: torch.dtype) -> None:
    """Raise ValueError unless the source rank of a broadcast passes a tensor of the announced shape and dtype."""
    if tensor is None or tensor.shape != tuple(shape) or tensor.dtype != dtype:
        found = None if tensor is None else f"{tuple(tensor.shape)} {tensor.dtype}"
        raise ValueError(f"broadcast: source rank {src} must pass a {tuple(shape)} {dtype} tensor, got {found}")


class TorchDistributedCommunicator:
    """``Communicator`` over the initialized default process group.

    Tensors are expected on the backend's device (the current CUDA device for NCCL, CPU otherwise);
    ``recv`` and ``broadcast`` allocate there. Sub-groups must be created upfront with
    ``create_groups`` (a collective call, same tuples on every rank) before the first collective.

    Args:
        timeout: seconds every wait may take before it raises ``CommunicationError``.
    """

    def __init__(self, timeout: float) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "TorchDistributedCommunicator needs the default process group: "
                "call torch.distributed.init_process_group(...) first"
            )
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.timeout = timeout
        self.device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        self.groups = GroupCache(timeout)
        # The channel of all_reduce_async: a second process group per tuple (the world's included).
        self._async_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        # By (dst, tag), in issue order: (work, the tensor it reads, description); the tensor must stay alive
        # until the send completes.
        self._pending_sends: dict[tuple[int, int], list[tuple[dist.Work, torch.Tensor, str]]] = {}
        # By (src, tag): receives posted ahead of their recv (post_recv), (work, buffer, description).
        self._posted: dict[tuple[int, int], tuple[dist.Work, torch.Tensor, str]] = {}
        # gloo moves a message when its receive is posted, so a receive posted after its message was sent waits for
        # the sender's communication thread (0.4-1.4 ms on average on shared cores, against 0.0-0.4 ms posted first).
        # NCCL runs a pair's messages in order on one stream: a receive posted early would hold up the sends behind it.
        self.posts_receives = dist.get_backend() == "gloo"

    def create_groups(self, all_rank_tuples: Iterable[Sequence[int]]) -> None:
        tuples = [tuple(sorted(ranks)) for ranks in all_rank_tuples]
        self.groups.create_groups(tuples)  # checks that every rank passed the same sub-world tuples
        # Same order on every rank: the sub-world tuples agree (checked above) and the world is always added.
        needed = {ranks for ranks in tuples if 1 < len(ranks) < self.world_size}
        if self.world_size > 1:
            needed.add(tuple(range(self.world_size)))
        for ranks in sorted(needed - set(self._async_groups), key=lambda ranks: (len(ranks), ranks)):
            self._async_groups[ranks] = dist.new_group(list(ranks), timeout=timedelta(seconds=self.timeout))

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        check_peer(dst, self.rank, self.world_size)
        tensor = tensor.detach().clone(memory_format=torch.contiguous_format)
        description = f"send to rank {dst} with tag {tag}"
        work = self._issue(lambda: dist.isend(tensor, dst, tag=tag), description)
        self._pending_sends.setdefault((dst, tag), []).append((work, tensor, description))

    def recv(self, shape: Sequence[int], dtype: torch.dtype, src: int, tag: int) -> torch.Tensor:
        work, tensor, description = self._posted.pop((src, tag), None) or self._irecv(shape, dtype, src, tag)
        self._wait(work, description)
        return tensor

    def post_recv(self, shape: Sequence[int], dtype: torch.dtype, src: int, tag: int) -> None:
        """Post the receive now on gloo; on NCCL ``recv`` posts it where it is called."""
        if not self.posts_receives:
            return
        if (src, tag) in self._posted:
            raise CommunicationError(f"rank {self.rank}: a receive from rank {src} with tag {tag} is already posted")
        self._posted[(src, tag)] = self._irecv(shape, dtype, src, tag)

    def _irecv(self, shape: Sequence[int], dtype: torch.dtype, src: int, tag: int) -> tuple[dist.Work, torch.Tensor, str]:
        """Start receiving into a new buffer: (work, buffer, description)."""
        check_peer(src, self.rank, self.world_size)
        tensor = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        description = f"recv from rank {src} with tag {tag}"
        return self._issue(lambda: dist.irecv(tensor, src, tag=tag), description), tensor, description

    def wait_sends(self) -> None:
        pending, self._pending_sends = self._pending_sends, {}
        for sends in pending.values():
            for work, _, description in sends:
                self._wait(work, description)

    @property
    def sends_in_flight(self) -> int:
        """Sends issued and not yet waited for (``wait_sends``, ``release_send``): this rank holds their copies."""
        return sum(map(len, self._pending_sends.values()))

    def release_send(self, dst: int, tag: int) -> None:
        sends = self._pending_sends.get((dst, tag))
        if not sends:
            return
        work, _, description = sends.pop(0)
        if not sends:
            del self._pending_sends[(dst, tag)]
        self._wait(work, description)

    def all_reduce(self, tensor: torch.Tensor, ranks: tuple[int, ...]) -> torch.Tensor:
        group = self._group(ranks)
        result = tensor.detach().clone(memory_format=torch.contiguous_format)
        if len(ranks) > 1:
            self._run(lambda: dist.all_reduce(result, group=group, async_op=True), f"all_reduce over ranks {ranks}")
        return result

    def all_reduce_async(self, tensor: torch.Tensor, ranks: tuple[int, ...], *, in_place: bool = False) -> "_TorchHandle":
        ranks = check_ranks(ranks, self.rank, self.world_size)
        result = check_in_place(tensor) if in_place else tensor.detach().clone(memory_format=torch.contiguous_format)
        description = f"all_reduce_async over ranks {ranks}"
        if len(ranks) == 1:
            return _TorchHandle(self, None, result, description)
        group = self._async_groups.get(ranks)
        if group is None:
            raise MissingGroupError(
                f"no process group for ranks {ranks}: pass every ranks tuple the program uses to "
                "create_groups(...) on every rank before the first collective"
            )
        return _TorchHandle(self, self._issue(lambda: dist.all_reduce(result, group=group, async_op=True), description), result, description)

    def all_gather(self, tensor: torch.Tensor, dim: int, ranks: tuple[int, ...]) -> torch.Tensor:
        group = self._group(ranks)
        tensor = tensor.detach().contiguous()
        chunks = [torch.empty_like(tensor) for _ in ranks]
        if len(ranks) > 1:
            self._run(lambda: dist.all_gather(chunks, tensor, group=group, async_op=True), f"all_gather over ranks {ranks}")
        else:
            chunks[0].copy_(tensor)
        return torch.cat(chunks, dim)

    def reduce_scatter(self, tensor: torch.Tensor, dim: int, ranks: tuple[int, ...]) -> torch.Tensor:
        group = self._group(ranks)
        check_divisible(tensor, dim, len(ranks), "reduce_scatter")
        chunks = [chunk.contiguous() for chunk in tensor.detach().chunk(len(ranks), dim)]
        result = torch.empty_like(chunks[0])
        if len(ranks) > 1:
            self._run(lambda: dist.reduce_scatter(result, chunks, group=group, async_op=True), f"reduce_scatter over ranks {ranks}")
        else:
            result.copy_(chunks[0])
        return result

    def all_to_all(self, tensor: torch.Tensor, split_dim: int, concat_dim: int, ranks: tuple[int, ...]) -> torch.Tensor:
        group = self._group(ranks)
        check_divisible(tensor, split_dim, len(ranks), "all_to_all")
        inputs = [chunk.contiguous() for chunk in tensor.detach().chunk(len(ranks), split_dim)]
        outputs = [torch.empty_like(chunk) for chunk in inputs]
        if len(ranks) > 1:
            self._run(lambda: dist.all_to_all(outputs, inputs, group=group, async_op=True), f"all_to_all over ranks {ranks}")
        else:
            outputs[0].copy_(inputs[0])
        return torch.cat(outputs, concat_dim)

    def broadcast(
        self, tensor: torch.Tensor | None, src: int, ranks: tuple[int, ...], shape: Sequence[int], dtype: torch.dtype
    ) -> torch.Tensor:
        group = self._group(ranks)
        if src not in ranks:
            raise ValueError(f"broadcast source rank {src} is not in ranks {ranks}")
        if self.rank == src:
            check_broadcast_source(tensor, src, shape, dtype)
            result = tensor.detach().clone(memory_format=torch.contiguous_format)
        else:
            result = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        if len(ranks) > 1:
            self._run(lambda: dist.broadcast(result, src=src, group=group, async_op=True), f"broadcast from rank {src} over ranks {ranks}")
        return result

    def barrier(self) -> None:
        self._run(lambda: dist.barrier(async_op=True), f"barrier over all {self.world_size} ranks")

    def _group(self, ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
        return self.groups.get(check_ranks(ranks, self.rank, self.world_size))

    def _issue(self, start: Callable[[], dist.Work], description: str) -> dist.Work:
        """``start()``, with a failure to even start (a peer already gone) raised as ``CommunicationError``."""
        try:
            return start()
        except Exception as error:  # gloo and NCCL raise RuntimeError / DistBackendError with the cause
            raise CommunicationError(f"rank {self.rank}: {description} could not start: {error}") from error

    def _run(self, start: Callable[[], dist.Work], description: str) -> None:
        """Start a collective and wait for it (``_issue``, ``_wait``)."""
        self._wait(self._issue(start, description), description)

    def _wait(self, work: dist.Work, description: str) -> None:
        try:
            completed = work.wait(timeout=timedelta(seconds=self.timeout))
        except Exception as error:  # gloo and NCCL raise RuntimeError / DistBackendError with the cause
            raise CommunicationError(
                f"rank {self.rank}: {description} failed or did not complete within {self.timeout} s: {error}"
            ) from error
        if completed is False:
            raise CommunicationError(f"rank {self.rank}: {description} did not complete within {self.timeout} s")


class _TorchHandle:
    """An ``all_reduce_async`` in flight on a process group; ``wait`` applies the communicator's timeout."""

    def __init__(self, communicator: TorchDistributedCommunicator, work: dist.Work | None, result: torch.Tensor, description: str) -> None:
        self._communicator, self._work, self._result, self._description = communicator, work, result, description

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._communicator._wait(self._work, self._description)
            self._work = None
        return self._result
