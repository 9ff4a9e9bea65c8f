"""Capture PyTorch's own ``nn.Transformer`` stacks when they are handed a mask and no ``is_causal`` hint.

``nn.TransformerEncoder.forward`` and ``nn.TransformerDecoder.forward`` (so ``nn.Transformer`` too)
call ``torch.nn.modules.transformer._detect_is_causal_mask(mask, is_causal, size)``, which, when
``is_causal`` is None, compares the mask with a freshly built causal mask and calls ``bool()`` on the
result: a branch on tensor values, which ``torch.export`` cannot capture (``GuardOnDataDependentSymNode``).
That is the usage PyTorch's own tutorial teaches (``tgt_mask=nn.Transformer.generate_square_subsequent_mask(T)``).

`causal_masks_known` patches both module-level helpers of ``torch.nn.modules.transformer`` for the
duration of one capture only (restored on exit, exceptions included; the rest of torch is untouched):

- ``_generate_square_subsequent_mask`` (what ``nn.Transformer.generate_square_subsequent_mask`` calls)
  remembers the masks it makes, so a mask built that way inside the step is known to be causal;
- ``_detect_is_causal_mask`` answers from that memory: ``True`` for a remembered mask of the expected
  size, as eager PyTorch would find by comparing values. For any other mask (built by hand, or passed
  in with the batch: a symbolic tensor while tracing, whose values cannot be compared) the answer is
  ``False``: the layers then apply the mask as an explicit ``attn_mask``, which computes exactly the same
  attention (``is_causal=True`` is only a hint that lets a kernel skip the mask), so the captured step
  equals the eager one either way. An explicit ``is_causal`` / ``tgt_is_causal`` is used as given.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.nn.modules import transformer as torch_transformer


@contextlib.contextmanager
def causal_masks_known() -> Iterator[None]:
    """Inside the block, ``nn.Transformer*`` decide ``is_causal`` without branching on tensor values (see the module docstring)."""
    generate, detect = torch_transformer._generate_square_subsequent_mask, torch_transformer._detect_is_causal_mask
    causal: list[torch.Tensor] = []  # compared by identity: a tensor's == is elementwise

    def generate_remembered(*args: Any, **kwargs: Any) -> torch.Tensor:
        mask = generate(*args, **kwargs)
        causal.append(mask)
        return mask

    def detect_from_memory(mask: torch.Tensor | None, is_causal: bool | None = None, size: int | None = None) -> bool:
        if is_causal is not None or mask is None:
            return detect(mask, is_causal, size)
        if any(known is mask for known in causal):
            rows = size if size is not None else mask.size(-2)
            return tuple(mask.shape) == (rows, rows)
        return False  # its values are unknown while tracing (comparing them would leave a dead .item() in the graph)

    torch_transformer._generate_square_subsequent_mask = generate_remembered
    torch_transformer._detect_is_causal_mask = detect_from_memory
    try:
        yield
    finally:
        torch_transformer._generate_square_subsequent_mask = generate
        torch_transformer._detect_is_causal_mask = detect
