"""``tensor.item()`` while ``training_step`` is traced: served to ``self.log``, refused in the loss math.

``self.log("loss", loss.item())`` is an everyday Lightning pattern: the number is only logged. While
the step is traced, ``Tensor.item`` returns an `ItemValue` that remembers its tensor; ``self.log``
logs that tensor instead (the captured graph computes it every step, and Lightning logs its value
after the step, as under ddp). Any other use of the number (arithmetic, a comparison, ``float()``)
would take a value out of the graph and freeze it at the trace, so it is refused naming the file and
line of the ``.item()`` call and the fix.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from lightning_nnscaler.capture.convert import CaptureError
from lightning_nnscaler.capture.step_values import user_location


class ItemValue:
    """The result of ``tensor.item()`` in a traced step: a stand-in that only ``self.log`` may take."""

    __slots__ = ("tensor", "location")

    def __init__(self, tensor: torch.Tensor, location: str) -> None:
        self.tensor, self.location = tensor, location

    def __repr__(self) -> str:
        return f"<.item() at {self.location}>"

    def refuse(self, use: str) -> None:
        raise CaptureError(
            f"training_step calls .item() at {self.location} and {use} its result: a Python number is taken out of the "
            "captured step, so every later step would use the traced value. Keep it a tensor (drop .item(), e.g. "
            "`loss / loss.detach()`); logging it is fine: self.log(name, tensor.item()) logs the tensor every step."
        )


def _refusing(use: str) -> Any:
    def method(self: ItemValue, *args: Any) -> Any:
        self.refuse(use)

    return method


for _name in """bool int float index round trunc floor ceil neg pos abs hash complex""".split():
    setattr(ItemValue, f"__{_name}__", _refusing(f"converts ({_name})"))
for _name in """eq ne lt le gt ge""".split():
    setattr(ItemValue, f"__{_name}__", _refusing(f"compares ({_name})"))
for _name in """add sub mul truediv floordiv mod divmod pow""".split():
    setattr(ItemValue, f"__{_name}__", _refusing(f"computes ({_name}) with"))
    setattr(ItemValue, f"__r{_name}__", _refusing(f"computes ({_name}) with"))


class _ItemValues(TorchFunctionMode):
    """``Tensor.item()`` on a one-element tensor returns an `ItemValue`; every other torch call runs as it is."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.item and len(args) == 1 and not kwargs and args[0].numel() == 1:
            return ItemValue(args[0], user_location())
        for value in (*args, *kwargs.values()):
            if isinstance(value, ItemValue):
                value.refuse(f"passes to {getattr(func, '__name__', func)}")
        return func(*args, **kwargs)


@contextlib.contextmanager
def item_values() -> Iterator[None]:
    """While tracing ``training_step``: ``tensor.item()`` returns `ItemValue`s."""
    with _ItemValues():
        yield
