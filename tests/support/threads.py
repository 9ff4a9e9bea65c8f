"""Ranks run as threads of one process (for code that takes a ``gather`` collective, e.g. ``save_sharded``)."""

from __future__ import annotations

import threading
from typing import Any


class ThreadGather:
    """``gather(obj)`` for ``world_size`` rank threads: every thread's object, by rank, once all have given theirs.

    Each thread calls ``enter(rank)`` first; a thread that fails calls ``abort()`` so the others stop waiting.
    """

    def __init__(self, world_size: int, timeout: float) -> None:
        self.slots: list[Any] = [None] * world_size
        self.barrier = threading.Barrier(world_size, timeout=timeout)
        self.local = threading.local()

    def enter(self, rank: int) -> None:
        self.local.rank = rank

    def __call__(self, obj: Any) -> list[Any]:
        self.barrier.wait()
        self.slots[self.local.rank] = obj
        self.barrier.wait()
        return list(self.slots)

    def abort(self) -> None:
        self.barrier.abort()
