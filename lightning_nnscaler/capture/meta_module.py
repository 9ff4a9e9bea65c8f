"""Capturing a module whose parameters and buffers lie on the meta device (built under deferred init).

``torch.export`` traces with fake tensors, and a meta parameter would stay on ``meta`` beside a batch on
the CPU or a GPU. While such a module is traced, each meta tensor is swapped for a fake tensor on the
batch's device (one per tensor, so tied weights stay tied) and the batch is made fake in the same mode;
the module gets its meta tensors back afterwards. No parameter is ever allocated.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import _pytree as pytree


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` lies on the meta device."""
    return any(tensor.is_meta for tensor in [*module.parameters(), *module.buffers()])


@contextlib.contextmanager
def traced_as_on(module: nn.Module, args: tuple[Any, ...]) -> Iterator[tuple[Any, ...]]:
    """``args`` to trace ``module`` with: as given where no tensor of ``module`` is on meta; otherwise
    fake, with the module's meta tensors swapped for fake ones on the batch's device until the block ends."""
    if not has_meta_tensors(module):
        yield args
        return
    leaves = [leaf for leaf in pytree.tree_leaves(args) if isinstance(leaf, torch.Tensor)]
    device = leaves[0].device if leaves else torch.device("cpu")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    fakes: dict[int, torch.Tensor] = {}
    try:
        for sub in module.modules():
            for table in (sub._parameters, sub._buffers):
                for name, tensor in table.items():
                    if tensor is not None and tensor.is_meta:
                        swapped.append((table, name, tensor))
                        table[name] = fakes.setdefault(id(tensor), _fake(mode, tensor, device))
        yield pytree.tree_map_only(torch.Tensor, mode.from_tensor, args)
    finally:
        for table, name, tensor in reversed(swapped):
            table[name] = tensor


def _fake(mode: FakeTensorMode, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    fake = FakeTensor(mode, tensor.detach(), device)
    return nn.Parameter(fake, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else fake
