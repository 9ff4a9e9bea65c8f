"""A text sample from a trained byte-level language model (rank 0, on the full module after fit)."""

from __future__ import annotations

from typing import Any

import torch

from lightning_nnscaler.app.config import SampleConfig
from lightning_nnscaler.data import decode, encode


@torch.no_grad()
def generate(module: Any, config: SampleConfig, seed: int = 0) -> str:
    """Continue ``config.prompt`` by ``config.tokens`` bytes, sampling at ``config.temperature`` (0: greedy).

    ``module(tokens)`` must map (1, T) token ids to (1, T, vocab) logits, with ``config.seq_len`` the
    longest context (the GPT reference model does).
    """
    was_training = module.training
    module.eval()
    generator = torch.Generator().manual_seed(seed)
    device = next(module.parameters()).device
    tokens = encode(config.prompt).to(device)  # (T,)
    context = module.config.seq_len
    for _ in range(config.tokens):
        logits = module(tokens[-context:][None])[0, -1].float().cpu()  # (vocab,)
        if config.temperature <= 0:
            token = logits.argmax()
        else:
            token = torch.multinomial(torch.softmax(logits / config.temperature, dim=-1), 1, generator=generator)[0]
        tokens = torch.cat([tokens, token.to(device).reshape(1)])
    module.train(was_training)
    return decode(tokens.cpu())
