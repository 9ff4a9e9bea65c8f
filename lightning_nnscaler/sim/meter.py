"""Measuring a step's memory: ``SavedMeter``, the peak bytes of the tensors autograd saves for backward, as
a program runs; ``AllocationMeter``, the peak of everything the allocator hands out (saved activations,
gradients in flight, outputs not yet freed), from the profiler's memory events on a CPU or the CUDA
allocator's statistics on a GPU.

Install its ``pack`` with ``torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack)``
(thread-local: one meter per thread). A storage is counted once however many saved tensors view it,
from the first save until the last of them is freed; storages in ``excluded`` (parameters, buffers)
are not counted.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile


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


class AllocationMeter:
    """Context manager: ``peak`` is the most bytes allocated at once inside it beyond what was allocated on entry.

    On a CPU it follows the profiler's memory events (every allocation and free of the CPU allocator, in the
    order they happened; the profiler slows the block, so meter a step apart from timed ones); on ``cuda`` it
    reads ``torch.cuda.max_memory_allocated``.
    """

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self.peak = 0
        self._profile: profile | None = None
        self._start = 0

    def __enter__(self) -> AllocationMeter:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._start = torch.cuda.memory_allocated()
        else:
            self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profile.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        if self._profile is None:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self._start
            return
        self._profile.__exit__(kind, error, trace)
        if kind is None:
            self.peak = peak_of_events(self._profile)


def peak_of_events(finished: profile) -> int:
    """The highest running sum of a finished CPU profile's allocations (+bytes) and frees (-bytes)."""
    events = sorted((event.start_ns(), event.nbytes()) for event in finished.profiler.kineto_results.events() if event.name() == "[memory]")
    current = peak = 0
    for _, nbytes in events:
        current += nbytes
        peak = max(peak, current)
    return peak
