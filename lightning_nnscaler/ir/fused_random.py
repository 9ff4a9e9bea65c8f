"""The plan-invariant draw of ``ir.randomness`` as one fused compiled kernel: the same values, bit for bit.

``torch.compile`` (inductor: one C++/OpenMP loop on CPU, one Triton kernel on GPU) turns the hash
of each element's index and its conversion to a uniform into a single pass (a normal draw's two
uniforms too; its Box-Muller stays eager, whose sqrt and cos compiled code rounds differently), and
``dropout_box`` fuses the whole dropout ``x * (uniform >= p) * scale`` (its backward regenerates the
mask instead of storing it). Shapes are dynamic: a box is reduced to at most ``MAX_RANK`` dimensions
of two or more elements (``canonical_box``), so one compiled kernel serves every box of a rank.

``LIGHTNING_NNSCALER_COMPILE_RANDOM`` picks when: ``auto`` (the default) for boxes of at least
``MIN_ELEMENTS`` elements, ``1`` for every box, ``0`` never. The first call of each kernel variant
(kernel, dtype, rank, device, CPU threads) checks some of its values against the eager draw's: a
compiler that fails turns the fused path off for the process, a kernel whose values differ turns
that kernel off, each with one warning; the eager draw then gives the values.
"""

from __future__ import annotations

import os
import types
import warnings
from typing import Any, Callable

import torch

from lightning_nnscaler.ir.randomness import (
    GOLDEN, current_stream, eager_random_box, normal_from_uniforms, precise_dtype, start_base, uniform_from_indices,
)

ENVIRONMENT = "LIGHTNING_NNSCALER_COMPILE_RANDOM"
MIN_ELEMENTS = 1 << 18
"""In ``auto`` mode, smaller boxes are drawn eagerly: a process's first compile costs seconds, which
boxes this small would take many thousands of draws to earn back (and tests with toy models never pay it)."""
MAX_RANK = 3
"""Boxes of more dimensions (after ``canonical_box``) are drawn eagerly."""
DEVICES = ("cpu", "cuda")

Extents = tuple[int, ...]
"""A canonical box's sizes then its strides in the full tensor but the innermost, which is one:
``(n0, .., n_r-1, s0, .., s_r-2)`` (a constant unit stride lets the compiled inner loop vectorize)."""

_state: dict[str, Any] = {"off": {}, "checked": set(), "compiled": {}}
"""Kernels turned off (name, or ``"*"`` for all, to why), variants checked, compiled kernels."""


def mode() -> str:
    """``"auto"``, ``"on"`` or ``"off"``, from ``LIGHTNING_NNSCALER_COMPILE_RANDOM`` (read at each call)."""
    value = os.environ.get(ENVIRONMENT, "auto").strip().lower()
    if value in ("0", "off", "false", "no"):
        return "off"
    return "on" if value in ("1", "on", "true", "yes") else "auto"


def wanted(numel: int, device: torch.device) -> bool:
    """Whether a box of ``numel`` elements on ``device`` is drawn by a fused kernel (when it works)."""
    chosen = mode()
    if chosen == "off" or "*" in _state["off"] or device.type not in DEVICES or numel < 2:
        return False
    if torch.compiler.is_compiling():
        return False
    return chosen == "on" or numel >= MIN_ELEMENTS


def canonical_box(size: list[int], offset: list[int], full_size: list[int]) -> tuple[int, list[int], list[int]]:
    """``(start, sizes, strides)``: the box's elements are ``start + sum(i_d * strides[d])`` for ``i_d < sizes[d]``.

    Dimensions of size one become part of ``start``, and a dimension merges with the one inside it
    when their elements are consecutive in the full tensor; every size left is at least two.
    """
    start, stride, sizes, strides = 0, 1, [], []
    for dim in reversed(range(len(size))):
        start += offset[dim] * stride
        if size[dim] != 1:
            if sizes and strides[0] * sizes[0] == stride:
                sizes[0] *= size[dim]
            else:
                sizes.insert(0, size[dim])
                strides.insert(0, stride)
        stride *= full_size[dim]
    return start, sizes, strides


def fusable(sizes: list[int], strides: list[int]) -> bool:
    """Whether the fused kernels draw this canonical box: at most ``MAX_RANK`` dimensions, innermost stride one."""
    return 0 < len(sizes) <= MAX_RANK and strides[-1] == 1


def box_indices(extents: Extents, device: torch.device) -> torch.Tensor:
    """Each element's index in the full tensor, counted from the box's ``start``, in the canonical box's shape."""
    rank = (len(extents) + 1) // 2
    strides = [*extents[rank:], 1]
    index = None
    for dim in range(rank):
        positions = torch.arange(extents[dim], dtype=torch.int64, device=device)
        positions = positions if dim == rank - 1 else positions * strides[dim]
        positions = positions.view([-1] + [1] * (rank - dim - 1))
        index = positions if index is None else index + positions
    return index


# Each kernel reads ``bases``: the hash offsets of its draws, then ``GOLDEN`` (see ``uniform_from_indices``).


def _uniform_kernel(bases: torch.Tensor, dtype: torch.dtype, *extents: int) -> torch.Tensor:
    return uniform_from_indices(box_indices(extents, bases.device), bases[0], dtype, bases[-1])


def _normal_kernel(bases: torch.Tensor, dtype: torch.dtype, *extents: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two uniforms of a normal draw; Box-Muller stays eager (compiled sqrt and cos round differently)."""
    indices = box_indices(extents, bases.device)
    precise = precise_dtype(dtype)
    return uniform_from_indices(indices, bases[0], precise, bases[-1]), uniform_from_indices(indices, bases[1], precise, bases[-1])


def _dropout_kernel(x: torch.Tensor, bases: torch.Tensor, p: float, scale: float, *strides: int) -> torch.Tensor:
    keep = uniform_from_indices(box_indices((*x.shape, *strides), x.device), bases[0], precise_dtype(x.dtype), bases[-1]) >= p
    return x * keep * scale


KERNELS: dict[str, Callable[..., torch.Tensor]] = {"uniform": _uniform_kernel, "normal": _normal_kernel, "dropout": _dropout_kernel}


def _variant(name: str, dtype: torch.dtype, rank: int, device: torch.device) -> tuple:
    """What a compiled kernel is specialized for; CPU kernels also for the thread count they were compiled under."""
    return (name, dtype, rank, device.type, torch.get_num_threads() if device.type == "cpu" else 0)


def _compiled(name: str, variant: tuple) -> Callable[..., torch.Tensor]:
    """Kernel ``name`` under ``torch.compile`` (dynamic shapes) for ``variant``, made once per process.

    Each variant compiles a copy of the kernel with its own code object: torch.compile caches (and
    limits recompiles) per code object, so variants neither evict nor count against each other.
    """
    if variant not in _state["compiled"]:
        kernel = KERNELS[name]
        label = kernel.__name__ + "_" + "_".join(str(part).replace("torch.", "") for part in variant)
        names = {"co_name": label} | ({"co_qualname": label} if hasattr(kernel.__code__, "co_qualname") else {})  # 3.11+
        code = kernel.__code__.replace(**names)
        copy = types.FunctionType(code, kernel.__globals__, code.co_name, kernel.__defaults__, kernel.__closure__)
        _state["compiled"][variant] = torch.compile(copy, dynamic=True, fullgraph=True)
    return _state["compiled"][variant]


def _turn_off(name: str, reason: str) -> None:
    """Draw eagerly instead of by kernel ``name`` (``"*"``: every kernel) from now on, saying why once."""
    if name not in _state["off"]:
        _state["off"][name] = reason
        warnings.warn(f"plan-invariant random ops fall back to the eager (unfused, slower) draw: {reason}; "
                      f"set {ENVIRONMENT}=0 to silence this", RuntimeWarning, stacklevel=4)


def _checked_positions(size: int) -> list[int]:
    """Where a new kernel variant's values are checked along a dimension of ``size``: both ends, the
    middle, and around the last full vector (where a vectorized loop hands over to its tail)."""
    return sorted({0, 1, size // 3, size // 2, max(size - 17, 0), size - 2, size - 1})


def _corner(values: torch.Tensor, positions: list[torch.Tensor]) -> torch.Tensor:
    """``values`` at ``positions`` along each dimension."""
    for dim, chosen in enumerate(positions):
        values = values.index_select(dim, chosen)
    return values


def _corner_indices(positions: list[torch.Tensor], strides: list[int]) -> torch.Tensor:
    """The indices (from the box's start) of the elements at ``positions`` of a canonical box of ``strides``."""
    index = None
    for dim, (chosen, stride) in enumerate(zip(positions, strides)):
        term = (chosen * stride).view([-1] + [1] * (len(positions) - dim - 1))
        index = term if index is None else index + term
    return index


Reference = Callable[[list[torch.Tensor], torch.Tensor], tuple[torch.Tensor, ...]]
"""The eager values a kernel must give at some positions of the canonical box, given their indices."""


def _run(name: str, variant: tuple, args: tuple, strides: list[int], reference: Reference) -> tuple[torch.Tensor, ...] | None:
    """Kernel ``name`` on ``args`` (``None`` if off); a variant's first result is checked against ``reference``
    at ``_checked_positions`` along each dimension."""
    if name in _state["off"] or "*" in _state["off"]:
        return None
    try:
        with torch.no_grad():  # one grad mode for every call: torch.compile guards it
            result = _compiled(name, variant)(*args)
    except Exception as error:  # no C compiler, no Triton, an inductor failure: draw eagerly instead
        _turn_off("*", f"compiling the fused {name} kernel failed ({type(error).__name__}: {str(error)[:300]})")
        return None
    result = result if isinstance(result, tuple) else (result,)
    if variant not in _state["checked"]:
        positions = [torch.tensor(_checked_positions(size), device=result[0].device) for size in result[0].shape]
        expected = reference(positions, _corner_indices(positions, strides))
        if not all(torch.equal(_corner(values, positions), wanted_values) for values, wanted_values in zip(result, expected)):
            _turn_off(name, f"the fused {name} kernel's values differ from the eager draw's ({variant})")
            return None
        _state["checked"].add(variant)
    return result


def fused_box(
    size: list[int], offset: list[int], full_size: list[int], key: int, distribution: str, dtype: torch.dtype, device: torch.device,
) -> torch.Tensor | None:
    """``randomness.random_box`` by a fused kernel, or ``None`` where the eager draw is to be used."""
    numel = 1
    for extent in size:
        numel *= extent
    if not wanted(numel, device) or not dtype.is_floating_point:
        return None
    start, sizes, strides = canonical_box(size, offset, full_size)
    if not fusable(sizes, strides):
        return None
    stream = current_stream()
    keys = [key] if distribution == "uniform" else [key, key + 1]
    bases = [start_base(each, stream, start) for each in keys]
    drawn = precise_dtype(dtype) if distribution == "normal" else dtype

    def reference(positions: list[torch.Tensor], indices: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(uniform_from_indices(indices, base, drawn) for base in bases)

    base_tensor = torch.tensor([*bases, GOLDEN], dtype=torch.int64, device=device)
    variant = _variant(distribution, dtype, len(sizes), device)
    result = _run(distribution, variant, (base_tensor, dtype, *sizes, *strides[:-1]), strides, reference)
    if result is None:
        return None
    if distribution == "normal":
        return normal_from_uniforms(*result, dtype).view(size)
    return result[0].view(size)


def _dropout_scale(p: float) -> float:
    return 0.0 if p >= 1 else 1.0 / (1.0 - p)


def _rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` (float32 or float64), as a Python float."""
    return value if dtype == torch.float64 else float(torch.tensor(value, dtype=dtype))


def _alias(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """``x`` (made contiguous) in shape ``sizes`` as a plain tensor over its memory, not a view of it:
    torch.compile guards a view's base, whose rank and strides would make it recompile."""
    x = x.detach().contiguous()
    strides, stride = [], 1
    for size in reversed(sizes):
        strides.insert(0, stride)
        stride *= size
    return torch.empty(0, dtype=x.dtype, device=x.device).set_(x.untyped_storage(), x.storage_offset(), sizes, strides)


def _masked(x: torch.Tensor, base: int, p: float, sizes: list[int], strides: list[int]) -> torch.Tensor:
    """``x * (uniform >= p) * scale`` with ``x`` viewed as the canonical box: fused, or by eager ops where that is off."""
    flat = _alias(x, sizes)
    compare = precise_dtype(x.dtype)

    def reference(positions: list[torch.Tensor], indices: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (_corner(flat, positions) * (uniform_from_indices(indices, base, compare) >= p) * _dropout_scale(p),)

    bases = torch.tensor([base, GOLDEN], dtype=torch.int64, device=x.device)
    variant = _variant("dropout", x.dtype, len(sizes), x.device)
    # eager ops round a Python number to the op's dtype (the comparison's, the multiply's op-math float): so does the kernel
    rounded = (_rounded(p, compare), _rounded(_dropout_scale(p), compare))
    result = _run("dropout", variant, (flat, bases, *rounded, *strides[:-1]), strides, reference)
    if result is not None:
        return result[0].view(x.shape)
    keep = uniform_from_indices(box_indices((*sizes, *strides[:-1]), x.device), base, compare) >= p
    return (flat * keep * _dropout_scale(p)).view(x.shape)


class _Dropout(torch.autograd.Function):
    """Fused dropout whose backward regenerates the mask (same hash offset) rather than saving it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, base: int, p: float, sizes: list[int], strides: list[int]) -> torch.Tensor:
        ctx.fused = (base, p, sizes, strides)
        return _masked(x, base, p, sizes, strides)

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _masked(gradient.contiguous(), *ctx.fused), None, None, None, None


def dropout_box(x: torch.Tensor, offset: list[int], full_size: list[int], key: int, p: float) -> torch.Tensor:
    """Dropout of ``x``, the box at ``offset`` of a tensor of shape ``full_size``, with op ``key``'s mask.

    Equal, bit for bit, to what capture writes: ``x * (random_box(uniform) >= p) * (1 / (1 - p))``
    with the uniform in ``precise_dtype(x.dtype)``; fused, forward and backward, where ``wanted``.
    """
    if wanted(x.numel(), x.device) and x.dtype.is_floating_point:
        start, sizes, strides = canonical_box(list(x.shape), list(offset), list(full_size))
        if fusable(sizes, strides):
            return _Dropout.apply(x, start_base(key, current_stream(), start), p, sizes, strides)
    uniform = eager_random_box(list(x.shape), list(offset), list(full_size), key, "uniform", precise_dtype(x.dtype), x.device)
    return x * (uniform >= p) * _dropout_scale(p)
