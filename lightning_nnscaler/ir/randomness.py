"""Plan-invariant random numbers: the same values whatever the plan, split, rank or microbatch.

Every element of a random tensor is a hash of ``(seed, step, draw, the op's key, the element's
linear index in the full tensor)`` (splitmix64 on torch int64 ops), turned into a uniform float
(or, by Box-Muller on two such uniforms, a normal one). Large boxes are hashed by one fused
compiled kernel instead (``ir.fused_random``), which gives the same values bit for bit. A piece of a random op therefore draws
exactly its own box of the full tensor, and never materializes the rest: the ops ``RANDOM_OP``
and ``RANDOM_LIKE_OP`` take the box's offsets, which ``op_trans`` sets for each piece (see
``ir.rules.shape``). The reference interpreter and the generated code call the same op.

The stream ``(seed, step, draw)`` is a process-wide value: the executor sets it before each step
(``set_stream``); backward's recomputation of a forward reads the same stream as the forward did.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass
from typing import Iterator

import torch

RANDOM_OP = "lnn.random.default"
"""The IR target of a random factory (``rand``, ``randn``): ``(size, offset, full_size, key, distribution, dtype, device)``."""
RANDOM_LIKE_OP = "lnn.random_like.default"
"""The IR target of a random tensor shaped like a template it reads no value of (dropout's mask is
shaped like its input): ``(template, offset, full_size, key, distribution, dtype)``; a split of the
template reaches it, so each piece draws only the box it holds."""

DISTRIBUTIONS = ("uniform", "normal")

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MULTIPLIERS = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
GOLDEN = _GOLDEN - (1 << 64)
"""splitmix64's increment as a signed int64: element ``i`` hashes ``i * GOLDEN + base``."""


@dataclass(frozen=True)
class RandomStream:
    """Which draw of the run a random op makes: the run's seed, the optimizer step and the batch's
    index within its gradient-accumulation window (so accumulated batches draw different masks)."""

    seed: int = 0
    step: int = 0
    draw: int = 0


_stream = [RandomStream()]


def set_stream(stream: RandomStream) -> None:
    """Make ``stream`` the one every random op of this process draws from (until set again)."""
    _stream[0] = stream


def current_stream() -> RandomStream:
    """The stream random ops draw from now."""
    return _stream[0]


@contextlib.contextmanager
def using_stream(stream: RandomStream) -> Iterator[None]:
    """Draw from ``stream`` inside the block, then restore the previous one."""
    previous = current_stream()
    set_stream(stream)
    try:
        yield
    finally:
        set_stream(previous)


def op_key(name: str) -> int:
    """A stable int64 key for a random op, from the name it was captured under."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little", signed=True)


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


def _mix(value: int) -> int:
    """splitmix64's finalizer on a Python int (mod 2**64)."""
    value &= _MASK64
    value = ((value ^ (value >> 30)) * _MULTIPLIERS[0]) & _MASK64
    value = ((value ^ (value >> 27)) * _MULTIPLIERS[1]) & _MASK64
    return value ^ (value >> 31)


def _shift_right(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's ``>>`` is arithmetic)."""
    return (values >> bits) & ((1 << (64 - bits)) - 1)


def _mix_tensor(values: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 tensors (multiplication wraps mod 2**64)."""
    values = (values ^ _shift_right(values, 30)) * _signed(_MULTIPLIERS[0])
    values = (values ^ _shift_right(values, 27)) * _signed(_MULTIPLIERS[1])
    return values ^ _shift_right(values, 31)


def _linear_indices(size: list[int], offset: list[int], full_size: list[int], device: torch.device) -> torch.Tensor:
    """Each element's row-major index in the full tensor, for the box ``offset : offset + size``."""
    index = torch.zeros(size, dtype=torch.int64, device=device)
    stride = 1
    for dim in reversed(range(len(size))):
        positions = torch.arange(offset[dim], offset[dim] + size[dim], dtype=torch.int64, device=device) * stride
        index = index + positions.view([-1] + [1] * (len(size) - dim - 1))
        stride *= full_size[dim]
    return index


def stream_base(key: int, stream: RandomStream) -> int:
    """The hash offset of op ``key``'s draw from ``stream`` (an unsigned 64-bit Python int)."""
    return _mix(_mix(_mix(_mix(stream.seed) ^ (stream.step & _MASK64)) ^ (stream.draw & _MASK64)) ^ (key & _MASK64))


def start_base(key: int, stream: RandomStream, start: int) -> int:
    """The signed int64 that ``uniform_from_indices`` adds to ``index * GOLDEN`` for indices counted from ``start``."""
    return _signed(stream_base(key, stream) + start * _GOLDEN)


def uniform_from_indices(
    indices: torch.Tensor, base: int | torch.Tensor, dtype: torch.dtype, golden: int | torch.Tensor = GOLDEN,
) -> torch.Tensor:
    """Uniforms in [0, 1) of the (signed int64) hash offset ``base`` at element ``indices`` (int64).

    ``golden`` is always ``GOLDEN``; compiled code passes it as a tensor so that the compiler does
    not fold it into index arithmetic (where C++ signed overflow is undefined, unlike in tensor ops).
    """
    bits = _mix_tensor(indices * golden + base)
    if dtype == torch.float64:
        return _shift_right(bits, 11).to(torch.float64) * 2.0**-53
    return (_shift_right(bits, 40).to(torch.float32) * 2.0**-24).to(dtype)


def precise_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype normal draws compute in before rounding to ``dtype`` (and dropout compares uniforms in)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def normal_from_uniforms(first: torch.Tensor, second: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Box-Muller: a standard normal from two independent uniforms (in ``precise_dtype``), rounded to ``dtype``."""
    radius = torch.sqrt(-2.0 * torch.log1p(-first))
    return (radius * torch.cos(2 * math.pi * second)).to(dtype)


def _uniform(indices: torch.Tensor, key: int, stream: RandomStream, dtype: torch.dtype) -> torch.Tensor:
    return uniform_from_indices(indices, start_base(key, stream, 0), dtype)


def random_box(
    size: list[int], offset: list[int], full_size: list[int], key: int, distribution: str = "uniform",
    dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
) -> torch.Tensor:
    """The box ``offset : offset + size`` of op ``key``'s random tensor of shape ``full_size``.

    ``distribution`` is ``"uniform"`` (in [0, 1)) or ``"normal"`` (mean 0, std 1, by Box-Muller on
    the uniforms of keys ``key`` and ``key + 1``). The values depend on the current stream, the
    key and each element's index in the full tensor only: any box of it gives the same values there.
    Large boxes are drawn by one fused compiled kernel when available (``ir.fused_random``), with
    the same values bit for bit; ``eager_random_box`` is the reference.
    """
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution {distribution!r} is none of {DISTRIBUTIONS}")
    from lightning_nnscaler.ir import fused_random  # it builds on this module's helpers

    fused = fused_random.fused_box(list(size), list(offset), list(full_size), key, distribution, dtype, torch.device(device))
    if fused is not None:
        return fused
    return eager_random_box(size, offset, full_size, key, distribution, dtype, device)


def eager_random_box(
    size: list[int], offset: list[int], full_size: list[int], key: int, distribution: str = "uniform",
    dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
) -> torch.Tensor:
    """``random_box`` by unfused torch ops (the reference the fused kernels must equal)."""
    stream = current_stream()
    indices = _linear_indices(list(size), list(offset), list(full_size), torch.device(device))
    if distribution == "uniform":
        return _uniform(indices, key, stream, dtype)
    precise = precise_dtype(dtype)
    return normal_from_uniforms(_uniform(indices, key, stream, precise), _uniform(indices, key + 1, stream, precise), dtype)


@torch.library.custom_op(RANDOM_OP.removesuffix(".default").replace(".", "::"), mutates_args=())
def _random_op(
    size: list[int], offset: list[int], full_size: list[int], key: int, distribution: str, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    return random_box(size, offset, full_size, key, distribution, dtype, device)


@_random_op.register_fake
def _random_op_shape(
    size: list[int], offset: list[int], full_size: list[int], key: int, distribution: str, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    return torch.empty(size, dtype=dtype, device=device)


@torch.library.custom_op(RANDOM_LIKE_OP.removesuffix(".default").replace(".", "::"), mutates_args=())
def _random_like_op(
    template: torch.Tensor, offset: list[int], full_size: list[int], key: int, distribution: str, dtype: torch.dtype
) -> torch.Tensor:
    return random_box(list(template.shape), offset, full_size, key, distribution, dtype, template.device)


@_random_like_op.register_fake
def _random_like_op_shape(
    template: torch.Tensor, offset: list[int], full_size: list[int], key: int, distribution: str, dtype: torch.dtype
) -> torch.Tensor:
    return torch.empty(template.shape, dtype=dtype, device=template.device)


def _no_gradient(context: object, gradient: torch.Tensor) -> tuple[None, ...]:
    """Random values do not depend on the template's values: nothing flows back to it."""
    return (None,) * 6


_random_like_op.register_autograd(_no_gradient)
