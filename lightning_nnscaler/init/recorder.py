"""Recording a module's construction on the meta device: every op that creates or writes a meta tensor.

Under ``recording_init``, with ``torch.device("meta")`` as the default device:

- ``DataFactoryMode`` (a ``TorchFunctionMode``): ``torch.tensor`` / ``as_tensor`` / ``asarray`` /
  ``Tensor.new_tensor`` copy Python data into a tensor without passing the dispatcher, so on the
  meta device their values would be lost. They are built on the recording device instead and moved
  to ``meta``, which the dispatcher sees as a copy of a constant.
- ``recorded_tensors_look_real``: torch's own ``nn.init.trunc_normal_``, ``orthogonal_``, ``dirac_``
  and ``sparse_`` return at once for a tensor whose ``is_meta`` is true (they would skip the draws
  and the generator would not advance); for the recorded tensors ``is_meta`` reads False inside
  the block (but to torch's printing), so they run their ops, which are recorded. Torch's
  truncated normal draws by rejection (how many draws depends on the values drawn), so
  ``_no_grad_trunc_normal_`` is recorded whole instead (``Recorder.record_call``): run on a real
  stand-in, and replayed as one call from the generator's state.
- ``Recorder`` (a ``TorchDispatchMode``): sees every aten op. One that creates a new meta storage
  or writes into one becomes a ``RecordedOp``; views cost nothing (a tensor is named by its storage
  and its geometry, ``TensorRef``). A random op (tag ``nondeterministic_seeded``) keeps its
  generator's state and is run once on a real stand-in of the same geometry and dropped, so the
  generator advances exactly as eager construction advances it.

What cannot be replayed is refused at once (``DeferredInitError``): an op without a meta kernel or
one that reads values (``.item()``, a copy to a real tensor), a random op drawing from a meta
tensor's values, an op writing a real tensor from a meta one.
"""

from __future__ import annotations

import sys
import traceback
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from lightning_nnscaler.ir.errors import NnScalerError

META = torch.device("meta")
_PACKAGE_DIRECTORY = str(Path(__file__).resolve().parent)
_TORCH_DIRECTORY = str(Path(torch.__file__).resolve().parent)
_TENSOR_PRINTING = str(Path(torch.__file__).resolve().parent / "_tensor_str.py")


class DeferredInitError(NnScalerError, RuntimeError):
    """An initialization that deferred init cannot replay exactly; the message names the tensor, the op and the fix."""


@dataclass(frozen=True)
class TensorRef:
    """A meta tensor in a recorded op: a view (offset, size, stride, dtype) of one recorded storage."""

    storage: int
    """The storage's index in the record (``Recorder.storage_ids``)."""
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class DeviceArgument:
    """Where a recorded op passed ``device=meta``: the replay passes the recording device."""


@dataclass
class RecordedOp:
    """One op that created or wrote meta storages, with its tensors as ``TensorRef`` or constants."""

    index: int
    function: torch._ops.OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    created: dict[int, int]
    """Flat output position -> storage index, for the outputs that are new storages."""
    written: frozenset[int]
    read: frozenset[int]
    generator: Optional[torch.Generator] = None
    """A random op's generator (the device's default one unless the op named one)."""
    generator_state: Optional[torch.Tensor] = None
    """The generator's state just before the op ran in eager construction."""


@dataclass
class RecordedStorage:
    """A meta storage seen under the recording: the ops that wrote it, and a tensor that keeps it alive."""

    keeper: torch.Tensor
    created_by: Optional[int]
    """The op that created it; None for a meta tensor made outside the recording (its values are unknown)."""
    writers: list[int] = field(default_factory=list)


def call_site() -> str:
    """The innermost frame of the user's code (not torch's, not this package's), for error messages."""
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith((_PACKAGE_DIRECTORY, _TORCH_DIRECTORY)) and "contextlib" not in frame.filename:
            return f"{frame.filename}:{frame.lineno} in {frame.name}"
    return "an unknown place"


def describe(tensor: torch.Tensor) -> str:
    """A tensor's shape and dtype, e.g. ``float32[4, 8]``."""
    return f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"


def _is_meta(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "meta"


def _is_real(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type != "meta"


def _written_arguments(function: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``function``'s schema marks as written (``Tensor(a!)``: in-place ``self``, ``out=``)."""
    written = []
    for position, argument in enumerate(function._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        written += [item for item in tree_flatten(value)[0] if isinstance(item, torch.Tensor)]
    return written


def default_generator(device: torch.device) -> torch.Generator:
    """The generator eager construction on ``device`` draws from."""
    if device.type == "cpu":
        return torch.default_generator
    module = torch.get_device_module(device.type)
    return module.default_generators[device.index if device.index is not None else module.current_device()]


class DataFactoryMode(TorchFunctionMode):
    """Builds tensors from Python data on the recording device, then moves them to ``meta`` (see the module docstring)."""

    FUNCTIONS = (torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor)

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_function__(self, function: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = dict(kwargs or {})
        data = _data_argument(function, args, kwargs)
        if function in self.FUNCTIONS and not isinstance(data, torch.Tensor):  # converting a tensor is dispatched
            device = kwargs.get("device")
            if function is torch.Tensor.new_tensor and device is None:
                device = args[0].device
            if device is None or torch.device(device).type == "meta":
                kwargs["device"] = self.device
                return function(*args, **kwargs).to(META)
        return function(*args, **kwargs)


def _data_argument(function: Callable, args: tuple, kwargs: dict) -> Any:
    """The data a ``DataFactoryMode.FUNCTIONS`` call converts (``Tensor.new_tensor``'s comes after ``self``)."""
    position = 1 if function is torch.Tensor.new_tensor else 0
    return args[position] if len(args) > position else kwargs.get("data", kwargs.get("obj"))


class Recorder(TorchDispatchMode):
    """Records the ops that create or write meta storages (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.ops: list[RecordedOp] = []
        self.storages: list[RecordedStorage] = []
        self.storage_ids: dict[int, int] = {}
        """A meta storage's address (``_cdata``; each is kept alive, so none is reused) -> its index."""
        self.versions: dict[int, tuple[weakref.ref, int]] = {}
        """``id(tensor)`` -> (the tensor, its version counter after its last recorded write)."""

    def __torch_dispatch__(self, function: torch._ops.OpOverload, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        inputs = tree_flatten((args, kwargs))[0]
        meta_inputs = [value for value in inputs if _is_meta(value)]
        if not meta_inputs and not _names_meta_device(inputs):
            return function(*args, **kwargs)
        if meta_inputs:  # `.to("cpu")` of a recorded tensor: the meta device stands for the recording device
            args, kwargs = tree_map(self._recording_device_as_meta, (args, kwargs))
        written = _written_arguments(function, args, kwargs)
        self._refuse_unreplayable(function, meta_inputs, written)
        generator_state = self._advance_generator(function, args, kwargs, meta_inputs, written) if _is_random(function) else None
        try:  # real arguments join the meta computation as meta tensors: eager mixes a CPU buffer with CPU weights freely
            output = function(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
        except Exception as error:
            raise _unrecordable(function, meta_inputs, error) from error
        self._record(function, args, kwargs, output, written, generator_state)
        return output

    def _recording_device_as_meta(self, value: Any) -> Any:
        return META if isinstance(value, torch.device) and value == self.device else value

    def _refuse_unreplayable(self, function: torch._ops.OpOverload, meta_inputs: list[torch.Tensor], written: list[torch.Tensor]) -> None:
        """Refuse an op that writes a real tensor from meta ones: eager gives it values the recording cannot."""
        real_written = [tensor for tensor in written if _is_real(tensor)]
        if real_written and meta_inputs:
            raise DeferredInitError(
                f"{function} at {call_site()} writes the real tensor {describe(real_written[0])} from the recorded meta tensor "
                f"{describe(meta_inputs[0])}: its values depend on an init deferred init has not run. Create that tensor on the "
                "default (meta) device too, or compute it after materialization (e.g. in reset_parameters)"
            )

    def _advance_generator(self, function: torch._ops.OpOverload, args: tuple, kwargs: dict, meta_inputs: list, written: list) -> tuple:
        """Run a random op once on real stand-ins (its draws depend only on shapes) and drop them.

        Returns the generator and its state before the op.
        """
        written_ids = {id(tensor) for tensor in written}
        drawn_from = [tensor for tensor in meta_inputs if id(tensor) not in written_ids]
        if drawn_from:
            raise DeferredInitError(
                f"the random op {function} at {call_site()} draws with parameters from the meta tensor {describe(drawn_from[0])}: "
                "its draws depend on values deferred init has not computed. Pass numbers (e.g. normal_(mean, std)), or build "
                "this module eagerly"
            )
        generator = _named_generator(function, args, kwargs) or default_generator(self.device)
        state = generator.get_state()

        def stand_in(value: Any) -> Any:
            if _is_meta(value):
                return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=self.device)
            return self.device if isinstance(value, torch.device) and value.type == "meta" else value

        function(*tree_map(stand_in, args), **tree_map(stand_in, kwargs))
        return generator, state

    def _record(
        self, function: torch._ops.OpOverload, args: tuple, kwargs: dict, output: Any, written: list, generator_state: Optional[tuple]
    ) -> None:
        """Append the op if it created or wrote meta storages; views are not recorded."""
        index = len(self.ops)
        read = frozenset(self._storage_of(value) for value in tree_flatten((args, kwargs))[0] if _is_meta(value))
        written_ids = frozenset(self._storage_of(tensor) for tensor in written if _is_meta(tensor))
        created = {
            position: self._add_storage(value, created_by=index)
            for position, value in enumerate(tree_flatten(output)[0])
            if _is_meta(value) and _address(value) not in self.storage_ids
        }
        if not created and not written_ids:
            return
        generator, state = generator_state or (None, None)
        self.ops.append(
            RecordedOp(
                index, function, tree_map(self._template, args), tree_map(self._template, kwargs),
                created, written_ids, read, generator, state,
            )
        )
        for storage in written_ids:
            self.storages[storage].writers.append(index)
        for tensor in written:
            if _is_meta(tensor):
                self.versions[id(tensor)] = (weakref.ref(tensor), -1)  # its version is read when the recording ends

    def freeze_versions(self) -> None:
        """Note each written tensor's version counter as the recording ends: a later in-place op bumps it."""
        self.versions = {key: (reference, reference()._version) for key, (reference, _) in self.versions.items() if reference() is not None}

    def record_call(self, function: Callable, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Record ``function(tensor, *args, **kwargs)``, an init that overwrites ``tensor`` from random draws, as one op.

        Run once on a real stand-in of ``tensor``'s geometry (the draws depend on nothing else), so
        the generator advances as eagerly; replayed as the same call on the real tensor.
        """
        if any(_is_meta(value) for value in tree_flatten((args, kwargs))[0]):
            raise DeferredInitError(
                f"{function.__name__} at {call_site()} takes meta tensors besides the one it fills; build this module eagerly"
            )
        generator = kwargs.get("generator") or default_generator(self.device)
        state = generator.get_state()
        function(torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=self.device), *args, **kwargs)
        storage = self._storage_of(tensor)
        arguments = (self._template(tensor), *args)
        touched = frozenset({storage})
        self.ops.append(RecordedOp(len(self.ops), function, arguments, kwargs, {}, touched, touched, generator, state))
        self.storages[storage].writers.append(len(self.ops) - 1)
        self.versions[id(tensor)] = (weakref.ref(tensor), -1)
        return tensor

    def _add_storage(self, tensor: torch.Tensor, created_by: Optional[int]) -> int:
        self.storage_ids[_address(tensor)] = len(self.storages)
        self.storages.append(RecordedStorage(tensor, created_by, [created_by] if created_by is not None else []))
        return len(self.storages) - 1

    def _storage_of(self, tensor: torch.Tensor) -> int:
        """The index of a meta tensor's storage; one made outside the recording is added as having unknown values."""
        address = _address(tensor)
        return self.storage_ids[address] if address in self.storage_ids else self._add_storage(tensor, created_by=None)

    def _template(self, value: Any) -> Any:
        """An argument as the replay needs it: a meta tensor as a ``TensorRef``, a real one copied, ``meta`` as ``DeviceArgument``."""
        if _is_meta(value):
            return TensorRef(self._storage_of(value), value.storage_offset(), tuple(value.shape), tuple(value.stride()), value.dtype)
        if isinstance(value, torch.Tensor):
            return value.detach().clone()  # eager read its value now; the caller may change it later
        if isinstance(value, torch.device) and value.type == "meta":
            return DeviceArgument()
        return value


_VALUE_READING = {
    "_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive", "item",
}
"""Ops whose result depends on their input's values (a number, a bool, an output shape): nothing to record."""


def _unrecordable(function: torch._ops.OpOverload, meta_inputs: list[torch.Tensor], error: Exception) -> DeferredInitError:
    """The error for an op that failed on the meta device: one that reads values, or one without a meta kernel."""
    tensors = ", ".join(describe(value) for value in meta_inputs) or "a new tensor"
    if function._schema.name.split("::")[-1] in _VALUE_READING:
        return DeferredInitError(
            f"{function} at {call_site()} reads the values of {tensors} (.item(), bool(tensor), an `if` on a comparison), which "
            "deferred init has not computed. Do this after materialization (or from numbers, not tensor values), "
            "or build this module eagerly"
        )
    return DeferredInitError(
        f"{function} on {tensors} at {call_site()} cannot run on the meta device ({type(error).__name__}: {error}), so deferred init "
        "cannot record it. Build this module eagerly (outside recording_init), or give the op a meta kernel (torch.library.register_fake)"
    )


def _address(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _to_meta(value: Any) -> Any:
    return value.to(META) if _is_real(value) and value.dim() > 0 else value


def _names_meta_device(inputs: list) -> bool:
    return any(isinstance(value, torch.device) and value.type == "meta" for value in inputs)


def _is_random(function: torch._ops.OpOverload) -> bool:
    return torch.Tag.nondeterministic_seeded in function.tags


def _named_generator(function: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Optional[torch.Generator]:
    for position, argument in enumerate(function._schema.arguments):
        if argument.name == "generator":
            return args[position] if position < len(args) else kwargs.get("generator")
    return None


@contextmanager
def recorded_tensors_look_real(recorder: Recorder) -> Iterator[None]:
    """Inside, ``is_meta`` is False for the tensors ``recorder`` records, and torch's truncated normal is recorded whole
    (see the module docstring). Both patches are process-wide and undone on exit; one block at a time."""
    if "is_meta" in torch.Tensor.__dict__:
        raise DeferredInitError("recording_init blocks do not nest: end the outer block before starting another")
    def is_meta(tensor: torch.Tensor) -> bool:
        if tensor.device.type != "meta":
            return False
        recorded = tensor.untyped_storage()._cdata in recorder.storage_ids
        return not recorded or sys._getframe(1).f_code.co_filename == _TENSOR_PRINTING  # printing must not read values

    trunc_normal = torch.nn.init._no_grad_trunc_normal_

    def recorded_trunc_normal(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if tensor.device.type == "meta" and tensor.untyped_storage()._cdata in recorder.storage_ids:
            return recorder.record_call(trunc_normal, tensor, *args, **kwargs)
        return trunc_normal(tensor, *args, **kwargs)

    torch.Tensor.is_meta = property(is_meta)  # type: ignore[assignment, method-assign]
    torch.nn.init._no_grad_trunc_normal_ = recorded_trunc_normal
    try:
        yield
    finally:
        del torch.Tensor.is_meta
        torch.nn.init._no_grad_trunc_normal_ = trunc_normal
