"""``SavedMeter``: the peak bytes of the tensors autograd saves for backward, as a program runs.

Install its ``pack`` with ``torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack)``
(thread-local: one meter per thread). A storage is counted once however many saved tensors view it,
from the first save until the last of them is freed; storages in ``excluded`` (parameters, buffers)
are not counted.
"""

from __future__ import annotations

from typing import Any

import torch


class SavedMeter:
    """Peak bytes of distinct storages saved for backward (those in ``excluded``, by data pointer, left out)."""

    def __init__(self, excluded: set[int] | None = None) -> None:
        self.excluded = excluded or set()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def pack(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The pack hook: count ``tensor``'s storage while anything saved keeps it."""
        storage = tensor.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if key in self.excluded or not nbytes:
            return tensor, None
        if key not in self.live:
            self.current += nbytes
            self.peak = max(self.peak, self.current)
            self.live[key] = 0
        self.live[key] += 1
        return tensor, _Release(self, key, nbytes)

    @staticmethod
    def unpack(saved: tuple[torch.Tensor, Any]) -> torch.Tensor:
        """The unpack hook: the tensor itself."""
        return saved[0]


class _Release:
    """Held by one saved tensor; uncounts its storage when the last of them is freed."""

    def __init__(self, meter: SavedMeter, key: int, nbytes: int) -> None:
        self.meter, self.key, self.nbytes = meter, key, nbytes

    def __del__(self) -> None:
        self.meter.live[self.key] -= 1
        if not self.meter.live[self.key]:
            del self.meter.live[self.key]
            self.meter.current -= self.nbytes
