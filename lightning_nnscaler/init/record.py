"""``recording_init`` and ``InitRecord``: build on the meta device, then materialize one tensor, box or piece at a time.

A tensor is materialized by replaying, on a full-size temporary on the recording device, the
recorded ops its storage needs (its own writes, and before each the writes of the storages it
reads), each random op from its generator's recorded state; the box is cut out and the temporary
freed. The memory held is about one full storage (for a parameter built the usual way: the
parameter) plus the box.
"""

from __future__ import annotations

import hashlib

from contextlib import contextmanager
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from lightning_nnscaler.init.recorder import (
    META, DataFactoryMode, DeferredInitError, DeviceArgument, RecordedOp, Recorder, TensorRef, describe, recorded_tensors_look_real,
)
from lightning_nnscaler.ir.box import Box, PieceLocation, region


_UNINITIALIZED = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like"}
"""Ops that allocate without writing: a storage only they touched holds whatever memory held."""


@contextmanager
def recording_init(device: str | torch.device = "cpu") -> Iterator[InitRecord]:
    """Build modules on the meta device while recording their initialization, as if built eagerly on ``device``.

    Inside, tensors are created on ``meta`` (nothing is allocated but the stand-ins of random ops,
    one at a time) and each random op advances ``device``'s generator as eager construction would:
    after the block the generator's state equals eager construction's. The record the block yields
    materializes any parameter or buffer later, with eager construction's values.

    Raises:
        DeferredInitError: an op inside cannot be replayed (see ``recorder``).
    """
    device = torch.device(device)
    if device.type == "meta":
        raise ValueError("recording_init(device=...) is the device eager construction would use (e.g. 'cpu'), not 'meta'")
    record = InitRecord(Recorder(device))
    try:
        with torch.device(META), DataFactoryMode(device), record.recorder, recorded_tensors_look_real(record.recorder):
            yield record
    finally:
        record.recorder.freeze_versions()
        record.recording = False


class InitRecord:
    """What ``recording_init`` recorded; materializes its tensors (all methods need the recording to have ended)."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.recording = True

    @property
    def device(self) -> torch.device:
        """The device the recorded ops replay on (eager construction's device)."""
        return self.recorder.device

    def materialize(
        self, module: nn.Module, key: str, box: Optional[Box] = None, *,
        device: Optional[torch.device | str] = None, dtype: Optional[torch.dtype] = None,
    ) -> torch.Tensor:
        """The values of parameter or buffer ``key`` of ``module`` (a state_dict key), or of its ``box``, on ``device``.

        Raises:
            DeferredInitError: ``key`` names no tensor of ``module``, its values were not recorded, it was
                changed after the recording ended, or ``box`` does not fit it.
        """
        return self.materialize_tensor(tensor_at(module, key), box, device=device, dtype=dtype, name=key)

    def materialize_tensor(
        self, tensor: torch.Tensor, box: Optional[Box] = None, *, device: Optional[torch.device | str] = None,
        dtype: Optional[torch.dtype] = None, name: str = "the tensor",
    ) -> torch.Tensor:
        """``materialize`` for a tensor itself; ``name`` is what errors call it. A real tensor's box is copied as it is."""
        full = self.full_view(tensor, name) if tensor.device.type == "meta" else tensor.detach()
        values = _cut(full, box, name)
        return values.to(device=device or values.device, dtype=dtype or values.dtype)

    def materialize_pieces(
        self, module: nn.Module, locations: Iterable[PieceLocation], *, device: Optional[torch.device | str] = None
    ) -> list[torch.Tensor]:
        """Each piece (a box, or a ZeRO chunk of one) of ``module``'s tensors, in the order given.

        The pieces of one storage (one tensor's several pieces, tied keys) come from one replay, and
        only one storage is held at a time.
        """
        locations = list(locations)
        by_storage: dict[Any, list[int]] = {}
        for position, location in enumerate(locations):
            tensor = tensor_at(module, location.state_key)
            by_storage.setdefault(self._storage_key(tensor), []).append(position)
        pieces: list[Optional[torch.Tensor]] = [None] * len(locations)
        for positions in by_storage.values():
            first = locations[positions[0]]
            tensor = tensor_at(module, first.state_key)
            full = self.full_view(tensor, first.state_key) if tensor.device.type == "meta" else tensor.detach()
            for position in positions:
                _check_box(full.shape, locations[position].box, locations[position].state_key)
                pieces[position] = locations[position].take(full).to(device or full.device)
            del full
        return pieces  # type: ignore[return-value]

    def materialize_module(self, module: nn.Module, *, device: Optional[torch.device | str] = None) -> nn.Module:
        """Replace every meta parameter and buffer of ``module`` by its values on ``device`` (default: the recording
        device), in place; tensors sharing a storage (tied weights) share it after. Holds the whole module: for
        tests and single-device runs."""
        device = torch.device(device) if device is not None else self.device
        replaced: dict[int, torch.Tensor] = {}
        bases: dict[int, torch.Tensor] = {}
        for prefix, owner in module.named_modules(remove_duplicate=False):
            for table in (owner._parameters, owner._buffers):
                for name, tensor in table.items():
                    if tensor is None or tensor.device.type != "meta":
                        continue
                    if id(tensor) not in replaced:
                        replaced[id(tensor)] = self._materialized_alias(tensor, f"{prefix}.{name}".lstrip("."), bases, device)
                    table[name] = replaced[id(tensor)]
        return module

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a meta tensor this record created (so it can materialize it)."""
        return tensor.device.type == "meta" and tensor.untyped_storage()._cdata in self.recorder.storage_ids

    def digest(self) -> str:
        """A hash of what was recorded (ops, shapes, the generator states of random ops): equal in two processes
        exactly when they built the same tensors with the same values (the same seed)."""
        hasher = hashlib.sha256()
        for op in self.recorder.ops:
            hasher.update(str(op.function).encode())
            hasher.update(repr([getattr(arg, "shape", arg) for arg in op.args if not isinstance(arg, torch.Tensor)]).encode())
            if op.generator_state is not None:
                hasher.update(op.generator_state.cpu().numpy().tobytes())
        return hasher.hexdigest()

    def tied_keys(self, module: nn.Module) -> list[tuple[str, ...]]:
        """The groups of ``module``'s state keys (parameters and buffers) that are one tensor's storage, e.g. tied weights."""
        groups: dict[Any, list[str]] = {}
        for key, tensor in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
            groups.setdefault(self._storage_key(tensor), []).append(key)
        return [tuple(keys) for keys in groups.values() if len(keys) > 1]

    def full_view(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """The values of a recorded meta tensor: a view, with its geometry, of its replayed storage."""
        storage = self._check_recorded(tensor, name)
        self._check_initialized(storage, tensor, name)
        base = self.replay(storage, name)
        return _view(base.untyped_storage(), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)

    def replay(self, storage: int, name: str = "the tensor") -> torch.Tensor:
        """Replay the ops recorded storage ``storage`` needs; returns a tensor whose storage holds its values."""
        ops = self.recorder.ops
        needed = self._needed_ops(storage, name)
        last_use: dict[int, int] = {}
        for index in needed:
            for other in (*ops[index].read, *ops[index].written, *ops[index].created.values()):
                last_use[other] = index
        real: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for index in needed:
                _run(ops[index], real, self.device)
                for other in [other for other, last in last_use.items() if last == index and other != storage]:
                    real.pop(other, None)  # no later op needs it: free it now
        return real[storage]

    def _needed_ops(self, storage: int, name: str) -> list[int]:
        """The ops, in recorded order, that ``storage``'s final values depend on.

        ``bound[s]``: the writes of storage ``s`` before this op index are needed; each needed op
        needs the storages it reads as they were just before it.
        """
        storages, ops = self.recorder.storages, self.recorder.ops
        bound = {storage: len(ops)}
        pending = [storage]
        needed: set[int] = set()
        while pending:
            current = pending.pop()
            if storages[current].created_by is None:
                raise DeferredInitError(
                    f"{name} depends on a meta tensor {describe(storages[current].keeper)} that was not created under recording_init, "
                    "so its values are unknown. Create every tensor the module's init uses inside the recording_init block"
                )
            for index in storages[current].writers:
                if index >= bound[current] or index in needed:
                    continue
                needed.add(index)
                for other in ops[index].read | ops[index].written:
                    if index > bound.get(other, -1):
                        bound[other] = index
                        pending.append(other)
        return sorted(needed)

    def _check_recorded(self, tensor: torch.Tensor, name: str) -> int:
        """The storage index of a meta tensor of this record, after checking that it was not changed after the recording."""
        if self.recording:
            raise DeferredInitError(f"materialize {name} after the recording_init block has ended, not inside it")
        storage = self.recorder.storage_ids.get(tensor.untyped_storage()._cdata)
        if storage is None:
            raise DeferredInitError(
                f"{name} ({describe(tensor)}) is on the meta device but was not created under this recording_init: "
                "build the module inside the recording_init block whose record you materialize from"
            )
        reference, version = self.recorder.versions.get(id(tensor), (None, None))
        if reference is not None and reference() is tensor and tensor._version != version:
            raise DeferredInitError(
                f"{name} ({describe(tensor)}) was changed in place after the recording_init block ended; that op was not "
                "recorded. Run the init inside the block (e.g. call reset_parameters or model.apply(init) there)"
            )
        return storage

    def _check_initialized(self, storage: int, tensor: torch.Tensor, name: str) -> None:
        """Refuse a tensor allocated with ``empty`` and never written: eager construction leaves garbage in it, no values to match."""
        recorded = self.recorder.storages[storage]
        creator = self.recorder.ops[recorded.created_by] if recorded.created_by is not None else None
        if creator is not None and recorded.writers == [creator.index] and creator.function._schema.name.split("::")[-1] in _UNINITIALIZED:
            raise DeferredInitError(
                f"{name} ({describe(tensor)}) was allocated by {creator.function} and never initialized under recording_init, so it has "
                "no values to materialize (Lightning's init_module(empty_init=True) skips torch.nn.init: use recording_init "
                "instead of it). "
                "Initialize it in the module's __init__ or reset_parameters, or load it (checkpoint.pretrained.read_slices)"
            )

    def _storage_key(self, tensor: torch.Tensor) -> Any:
        if tensor.device.type == "meta":
            return ("meta", tensor.untyped_storage()._cdata)
        return ("real", tensor.untyped_storage().data_ptr(), tensor.device)

    def _materialized_alias(self, tensor: torch.Tensor, name: str, bases: dict[int, torch.Tensor], device: torch.device) -> torch.Tensor:
        """``tensor``'s values as a view of its storage's one materialized copy on ``device`` (a Parameter stays one)."""
        storage = self._check_recorded(tensor, name)
        self._check_initialized(storage, tensor, name)
        if storage not in bases:
            base = self.replay(storage, name).untyped_storage()
            bases[storage] = _view(base, 0, (base.nbytes(),), (1,), torch.uint8).to(device)
        values = _view(bases[storage].untyped_storage(), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        return nn.Parameter(values, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else values


def tensor_at(module: nn.Module, key: str) -> torch.Tensor:
    """The parameter or buffer of ``module`` named by state key ``key``."""
    prefix, _, name = key.rpartition(".")
    try:
        owner = module.get_submodule(prefix)
    except AttributeError:
        owner = None
    tensor = None if owner is None else owner._parameters.get(name, owner._buffers.get(name))
    if tensor is None:
        raise DeferredInitError(f"{key!r} names no parameter or buffer of {type(module).__name__}: pass a key of its state_dict()")
    return tensor


def _cut(full: torch.Tensor, box: Optional[Box], name: str) -> torch.Tensor:
    """A contiguous copy of ``box`` of ``full`` (all of it when ``box`` is None)."""
    if box is None:
        return full.clone(memory_format=torch.contiguous_format)
    _check_box(full.shape, box, name)
    return full[region(box)].clone(memory_format=torch.contiguous_format)


def _check_box(shape: torch.Size, box: Box, name: str) -> None:
    if len(box) != len(shape) or any(not 0 <= start <= stop <= size for (start, stop), size in zip(box, shape)):
        raise DeferredInitError(f"box {list(box)} does not fit {name} of shape {list(shape)}: give one (start, stop) per dim within it")


def _view(storage: torch.UntypedStorage, offset: int, size: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride)


def _run(op: RecordedOp, real: dict[int, torch.Tensor], device: torch.device) -> None:
    """Run one recorded op on real tensors, from its generator's recorded state if it is random; keep the storages it creates."""

    def resolve(value: Any) -> Any:
        if isinstance(value, TensorRef):
            return _view(real[value.storage].untyped_storage(), value.offset, value.size, value.stride, value.dtype)
        return device if isinstance(value, DeviceArgument) else value

    args, kwargs = tree_map(resolve, op.args), tree_map(resolve, op.kwargs)
    if op.generator is None:
        output = op.function(*args, **kwargs)
    else:
        state = op.generator.get_state()
        op.generator.set_state(op.generator_state)
        try:
            output = op.function(*args, **kwargs)
        finally:
            op.generator.set_state(state)  # the caller's draws go on as if nothing had been replayed
    flat = tree_flatten(output)[0]
    for position, storage in op.created.items():
        real[storage] = flat[position]
