"""A communicator that records when each of a rank's operations was issued and returned.

``sim.in_step`` matches these records across ranks into the durations the simulator's ``cpu`` spec is
calibrated on (``benchmarks/calibrate_comm.py``); the ranks of one machine share its monotonic clock
(``time.perf_counter``), so records of different ranks compare.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_nnscaler.runtime.comm import TorchDistributedCommunicator


@dataclass
class Event:
    """One communication operation on one rank: ``key`` is the peer pair (src, dst) or the group's ranks."""

    kind: str
    key: tuple[int, ...]
    nbytes: int
    issued: float
    returned: float | None = None
    wait_started: float | None = None
    issue_returned: float | None = None
    """A send or an asynchronous sum: when the call that issued it returned."""
    posted: bool = False
    """A receive posted ahead, where its message was sent (``post_recv``): ``issued`` is when the rank waited for it."""

    def windows(self) -> list[tuple[float, float]]:
        """When the rank was in this operation (not computing): its issuing call, and its wait or whole call."""
        spans = [] if self.issue_returned is None else [(self.issued, self.issue_returned)]
        start = self.wait_started if self.wait_started is not None else (None if self.kind == "send" else self.issued)
        if start is not None and self.returned is not None:
            spans.append((start, self.returned))
        return spans

    def waiting(self, moment: float) -> bool:
        """Whether the rank was in this operation (not computing) at ``moment``."""
        return any(start <= moment <= end for start, end in self.windows())


class LoggedCommunicator(TorchDistributedCommunicator):
    """``TorchDistributedCommunicator`` that records an ``Event`` per send, receive and collective in ``events``."""

    def __init__(self, timeout: float) -> None:
        super().__init__(timeout)
        self.events: list[Event] = []

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        """Send, recording when it was issued and when the issuing call returned (the transfer goes on after it)."""
        event = Event("send", (self.rank, dst), tensor.numel() * tensor.element_size(), time.perf_counter())
        super().send(tensor, dst, tag)
        event.issue_returned = time.perf_counter()
        self.events.append(event)

    def recv(self, shape: Sequence[int], dtype: torch.dtype, src: int, tag: int) -> torch.Tensor:
        """Receive, recording when it was issued and when it returned."""
        issued, posted = time.perf_counter(), (src, tag) in self._posted
        tensor = super().recv(shape, dtype, src, tag)
        self.events.append(Event("recv", (src, self.rank), tensor.numel() * tensor.element_size(), issued, time.perf_counter(), posted=posted))
        return tensor

    def all_reduce(self, tensor: torch.Tensor, ranks: tuple[int, ...]) -> torch.Tensor:
        """Sum, recorded."""
        return self._logged("all_reduce", ranks, tensor, lambda: super(LoggedCommunicator, self).all_reduce(tensor, ranks))

    def all_gather(self, tensor: torch.Tensor, dim: int, ranks: tuple[int, ...]) -> torch.Tensor:
        """Gather, recorded."""
        return self._logged("all_gather", ranks, tensor, lambda: super(LoggedCommunicator, self).all_gather(tensor, dim, ranks))

    def reduce_scatter(self, tensor: torch.Tensor, dim: int, ranks: tuple[int, ...]) -> torch.Tensor:
        """Reduce-scatter, recorded."""
        return self._logged("reduce_scatter", ranks, tensor, lambda: super(LoggedCommunicator, self).reduce_scatter(tensor, dim, ranks))

    def all_to_all(self, tensor: torch.Tensor, split_dim: int, concat_dim: int, ranks: tuple[int, ...]) -> torch.Tensor:
        """All-to-all, recorded."""
        return self._logged("all_to_all", ranks, tensor, lambda: super(LoggedCommunicator, self).all_to_all(tensor, split_dim, concat_dim, ranks))

    def all_reduce_async(self, tensor: torch.Tensor, ranks: tuple[int, ...], *, in_place: bool = False) -> Any:
        """Start a sum; its handle's ``wait`` records when the wait began and returned."""
        event = Event("all_reduce", tuple(ranks), tensor.numel() * tensor.element_size(), time.perf_counter())
        handle = super().all_reduce_async(tensor, ranks, in_place=in_place)
        event.issue_returned = time.perf_counter()
        self.events.append(event)
        wait = handle.wait

        def logged_wait() -> torch.Tensor:
            event.wait_started = time.perf_counter()
            result = wait()
            event.returned = time.perf_counter()
            return result

        handle.wait = logged_wait
        return handle

    def _logged(self, kind: str, ranks: tuple[int, ...], tensor: torch.Tensor, run: Any) -> torch.Tensor:
        issued = time.perf_counter()
        result = run()
        self.events.append(Event(kind, tuple(ranks), tensor.numel() * tensor.element_size(), issued, time.perf_counter()))
        return result
