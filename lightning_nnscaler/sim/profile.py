"""Measured op times: a database of small repeated runs of each op on this device, cached on disk.

An op is keyed by its target, its input pieces' shapes and dtypes, its other arguments, the device
and the intra-op threads; the cache is a JSON file per device in the user's cache directory
(``platformdirs``; ``LNN_PROFILE_CACHE`` overrides the folder), never in the repository. A miss
runs the op on random inputs of the pieces' shapes (integers as zeros, so indices stay in range):
a warm-up, then repeats until ``min_seconds`` or ``max_repeats``; the forward's time and the
forward+backward's minus it, each the ``statistic`` of the repeats (the median; ``min`` on a shared
machine, where other processes only ever add time). Ops that cannot run alone fall back to the roofline.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from lightning_nnscaler.ir import randomness  # noqa: F401 - registers torch.ops.lnn.random*
from lightning_nnscaler.ir.op import Op, resolve_target
from lightning_nnscaler.ir.tensor import VTensor
from lightning_nnscaler.sim.costs import FLOATING, VIEWS, ComputeModel, OpTime, Roofline, op_work
from lightning_nnscaler.sim.specs import load_spec, spec_for_device


def cache_directory() -> Path:
    """Where profiles are kept: ``$LNN_PROFILE_CACHE`` or the user cache directory of lightning-nnscaler."""
    override = os.environ.get("LNN_PROFILE_CACHE")
    if override:
        return Path(override)
    import platformdirs

    return Path(platformdirs.user_cache_dir("lightning-nnscaler")) / "profiles"


def device_tag(device: str = "cpu") -> str:
    """A name for the device a profile holds (the CPU model, or the CUDA device's name) and the threads used."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device)).replace(" ", "_")
    return f"cpu-{platform.machine()}-{torch.get_num_threads()}threads"


def op_key(op: Op, device: str) -> str:
    """The cache key of ``op``: target, input shapes and dtypes, other arguments, device and threads."""
    args, kwargs = op.map_tensor_inputs(lambda _, piece: ("T", piece.shape, piece.tensor.dtype))
    return json.dumps([op.target, _plain(args), _plain(kwargs), op.no_grad, device_tag(device)], default=str)


def _plain(value: object) -> object:
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value if isinstance(value, (int, float, str, bool)) or value is None else str(value)


@dataclass
class ProfileDB:
    """Measured ``OpTime`` by ``op_key``, loaded from and saved to ``path`` (JSON)."""

    path: Path
    entries: dict[str, tuple[float, float]] = field(default_factory=dict)

    @classmethod
    def open(cls, device: str = "cpu", directory: Path | None = None) -> ProfileDB:
        """The database of ``device`` in ``directory`` (default ``cache_directory()``), empty when new."""
        path = (directory or cache_directory()) / f"{device_tag(device)}.json"
        entries = {}
        if path.is_file():
            with contextlib.suppress(ValueError):
                entries = {key: tuple(value) for key, value in json.loads(path.read_text()).items()}
        return cls(path, entries)

    def save(self) -> None:
        """Write the entries (atomically: a temporary file, then a rename)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(".tmp")
        partial.write_text(json.dumps(self.entries))
        partial.replace(self.path)


def measure_op(
    op: Op, device: str = "cpu", *, min_seconds: float = 0.01, max_repeats: int = 20, statistic: Callable[[list[float]], float] = statistics.median,
) -> OpTime:
    """Run ``op`` alone on random inputs of its shapes; forward and backward seconds (``statistic`` of the repeats).

    Raises:
        RuntimeError: when the op cannot run on made-up inputs (e.g. it needs real indices).
    """
    work = op_work(op)
    args, kwargs = op.map_tensor_inputs(lambda _, piece: _random(piece, device, work.has_backward))
    function = resolve_target(op.target)
    leaves = [value for value in _tensors((args, kwargs)) if value.requires_grad]

    def forward() -> list[torch.Tensor]:
        with torch.set_grad_enabled(bool(leaves)):
            result = function(*args, **dict(kwargs))
        results = result if isinstance(result, (tuple, list)) else (result,)
        return [value for value in results if isinstance(value, torch.Tensor) and value.requires_grad]

    def forward_backward() -> None:
        outputs = forward()
        if outputs and leaves:
            torch.autograd.grad(outputs, leaves, [torch.ones_like(value) for value in outputs], allow_unused=True)

    forward_seconds = _seconds(forward, device, min_seconds, max_repeats, statistic)
    if not (work.has_backward and leaves) or op.target in VIEWS:
        return OpTime(forward_seconds, 0.0 if not work.has_backward else forward_seconds)
    both = _seconds(forward_backward, device, min_seconds, max_repeats, statistic)
    backward = both - forward_seconds
    # on a busy machine the difference of two noisy timings can vanish: price the backward as the roofline does
    return OpTime(forward_seconds, backward if backward > 0 else 2 * forward_seconds)


def _random(piece: VTensor, device: str, grad: bool) -> torch.Tensor:
    dtype = getattr(torch, piece.tensor.dtype)
    if piece.tensor.dtype in FLOATING:
        return torch.randn(piece.shape, dtype=dtype, device=device).requires_grad_(grad)
    if dtype is torch.bool:
        return torch.ones(piece.shape, dtype=dtype, device=device)
    return torch.zeros(piece.shape, dtype=dtype, device=device)


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in _tensors(item)]
    return []


GPU_SAMPLE_SECONDS = 1e-3
"""Where the profiler cannot see kernels, each GPU sample times back-to-back calls lasting about this long,
then one synchronization."""
KERNEL_CALLS = 5


def _kernel_seconds(run: Callable[[], object]) -> float:
    """The GPU time of one ``run()``: its kernels' durations (the profiler's, over ``KERNEL_CALLS`` calls), 0.0
    where none were seen. In a training step the CPU queues kernels ahead of the GPU, so neither the wait
    after a call nor the framework's time on the CPU is the op's; timed alone, a small op is mostly those."""
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as recorded:
            for _ in range(KERNEL_CALLS):
                run()
            torch.cuda.synchronize()
        events = recorded.profiler.kineto_results.events()
        nanoseconds = sum(event.duration_ns() for event in events if event.device_type() == torch.autograd.DeviceType.CUDA)
    except (RuntimeError, AttributeError):
        return 0.0
    return nanoseconds / 1e9 / KERNEL_CALLS


def _seconds(run: Callable[[], object], device: str, min_seconds: float, max_repeats: int, statistic: Callable[[list[float]], float]) -> float:
    synchronize = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    run()
    synchronize()
    calls = 1
    if device.startswith("cuda"):
        kernels = _kernel_seconds(run)
        if kernels:
            return kernels
        start = time.perf_counter()
        run()
        synchronize()
        calls = max(1, min(100, int(GPU_SAMPLE_SECONDS / max(time.perf_counter() - start, 1e-7))))
    samples: list[float] = []
    total = 0.0
    while len(samples) < 3 or (total < min_seconds and len(samples) < max_repeats):
        start = time.perf_counter()
        for _ in range(calls):
            run()
        synchronize()
        samples.append((time.perf_counter() - start) / calls)
        total += samples[-1] * calls
    return statistic(samples)


@dataclass
class Profiled:
    """Measured op times from ``database`` (measuring misses when ``measure``), else ``fallback``'s."""

    database: ProfileDB
    fallback: ComputeModel
    device: str = "cpu"
    measure: bool = True
    statistic: Callable[[list[float]], float] = statistics.median
    misses: int = 0

    def op_time(self, op: Op) -> OpTime:
        """The op's measured forward and backward seconds (measured now on a miss)."""
        key = op_key(op, self.device)
        entry = self.database.entries.get(key)
        if entry is None and self.measure:
            self.misses += 1
            try:
                measured = measure_op(op, self.device, statistic=self.statistic)
            except Exception:  # noqa: BLE001 - an op that cannot run alone is priced by the fallback
                return self.fallback.op_time(op)
            entry = self.database.entries[key] = (measured.forward, measured.backward)
        return OpTime(*entry) if entry is not None else self.fallback.op_time(op)


def measured_prices(device: str = "cpu") -> Callable[[Sequence[Op]], list[float]]:
    """A pricing of ops by their forward plus backward seconds measured alone on ``device`` (``Profiled``, cached per
    device; ops that cannot run alone priced by the device's shipped spec's roofline): a pipeline's
    ``balance="measured"`` cuts stages of equal measured time by it.

    Each distinct op is timed once (the fastest of its repeats: other processes only ever add time).
    """

    def prices(ops: Sequence[Op]) -> list[float]:
        name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"
        profiled = Profiled(ProfileDB.open(device), Roofline(load_spec(spec_for_device(name)[0])), device, statistic=min)
        seconds = [profiled.op_time(op) for op in ops]
        if profiled.misses:
            with contextlib.suppress(OSError):  # a read-only cache directory still prices the ops
                profiled.database.save()
        return [op_seconds.forward + op_seconds.backward for op_seconds in seconds]

    return prices
