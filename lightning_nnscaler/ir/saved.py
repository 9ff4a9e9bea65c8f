"""What autograd saves for backward when one op runs, measured once per op kind and shape.

``saved_by(op, requires_grad)`` runs the op on ``meta`` tensors of its input pieces' shapes
(``ir.interpret.call_op``) under ``saved_tensors_hooks`` and sorts each saved tensor by its
storage: one of the op's inputs (or a view of it), one of its outputs, or a buffer of the op's own
(e.g. layer norm's mean and inverse deviation; only its bytes matter). It also records which outputs
are views of an input (they share its storage, so keeping both costs one). Results are cached per
target, argument structure, shapes, dtypes and which inputs require grad; an op that cannot run on
``meta`` gives ``None`` (the caller falls back to keeping all its outputs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from lightning_nnscaler.ir.interpret import call_op
from lightning_nnscaler.ir.op import Op
from lightning_nnscaler.ir.tensor import VTensor

ATTENTION = "aten.scaled_dot_product_attention.default"
NOT_ACTIVATIONS = ("parameter", "buffer", "constant")
"""Tensor roles whose saved storages are not activations: they exist whether or not backward runs."""


@dataclass(frozen=True)
class Saved:
    """One op call's saved-for-backward tensors: input and output positions, and the bytes of its own buffers."""

    inputs: tuple[int, ...]
    """Positions (in ``Op.tensor_inputs``) of the inputs saved, or saved through a view of them."""
    outputs: tuple[int, ...]
    """Positions of the outputs saved."""
    internal_bytes: int
    """Bytes of saved storages that are neither an input nor an output."""
    aliases: tuple[tuple[int, int], ...]
    """``(output, input)``: the output is a view of the input (the same storage)."""


_CACHE: dict[Any, Saved | None] = {}


def saved_by(op: Op, requires_grad: Sequence[bool]) -> Saved | None:
    """What autograd saves when ``op`` runs with input piece ``i`` requiring grad as ``requires_grad[i]``; ``None`` if it fails on meta."""
    key = (op.target, _structure(op.args), _structure(op.kwargs), tuple(requires_grad), _sharing(op.tensor_inputs))
    if key not in _CACHE:
        _CACHE[key] = _measure(op, requires_grad)
    return _CACHE[key]


def _measure(op: Op, requires_grad: Sequence[bool]) -> Saved | None:
    values: dict[VTensor, torch.Tensor] = {}
    for piece, grad in zip(op.tensor_inputs, requires_grad, strict=True):
        if piece not in values:
            values[piece] = _meta_tensor(piece, grad)
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    try:
        with torch.inference_mode(False), torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            results = _fused_attention(op, values) or call_op(op, lambda _, piece: values[piece])
    except Exception:  # noqa: BLE001 - any op that cannot run on meta falls back to the output rule
        return None
    input_storage: dict[int, int] = {}
    for position, piece in enumerate(op.tensor_inputs):
        input_storage.setdefault(_storage(values[piece]), position)
    output_storage: dict[int, int] = {}
    for position, result in enumerate(results):
        if isinstance(result, torch.Tensor):
            output_storage.setdefault(_storage(result), position)
    inputs, outputs, internal = set(), set(), {}
    for tensor in saved:
        storage = _storage(tensor)
        if storage in input_storage:
            inputs.add(input_storage[storage])
        elif storage in output_storage:
            outputs.add(output_storage[storage])
        else:
            internal[storage] = tensor.untyped_storage().nbytes()
    aliases = tuple((output, input_storage[storage]) for storage, output in output_storage.items() if storage in input_storage)
    return Saved(tuple(sorted(inputs)), tuple(sorted(outputs)), sum(internal.values()), aliases)


def _fused_attention(op: Op, values: dict[VTensor, torch.Tensor]) -> tuple[torch.Tensor, ...] | None:
    """``scaled_dot_product_attention`` as the fused kernel runs it (saving query, key, value, output and
    the row log-sum-exp), where the fused kernel applies: no mask, no dropout; ``None`` otherwise.

    On ``meta`` the op would take its unfused path, which saves the attention matrix; the CPU and
    CUDA devices pick a fused kernel for such calls."""
    if op.target != ATTENTION:
        return None
    args, kwargs = op.map_tensor_inputs(lambda _, piece: values[piece])
    bound = {**dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal"), args)), **dict(kwargs)}
    if bound.get("attn_mask") is not None or bound.get("dropout_p") or bound.get("enable_gqa"):
        return None
    output, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
        bound["query"], bound["key"], bound["value"], 0.0, bool(bound.get("is_causal", False)), scale=bound.get("scale")
    )
    return (output,)


def _meta_tensor(piece: VTensor, requires_grad: bool) -> torch.Tensor:
    dtype = getattr(torch, piece.tensor.dtype)
    tensor = torch.empty(piece.shape, dtype=dtype, device="meta")
    return tensor.requires_grad_(requires_grad and tensor.is_floating_point())


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _structure(value: Any) -> Any:
    """A hashable stand-in for an argument: pieces by shape and dtype, containers by their items."""
    if isinstance(value, VTensor):
        return ("tensor", value.shape, value.tensor.dtype)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_structure(item) for item in value))
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return (type(value).__name__, value)


def _sharing(pieces: Sequence[VTensor]) -> tuple[int, ...]:
    """Per input position, the first position holding the same piece (an op may read one tensor twice)."""
    first: dict[VTensor, int] = {}
    return tuple(first.setdefault(piece, position) for position, piece in enumerate(pieces))
