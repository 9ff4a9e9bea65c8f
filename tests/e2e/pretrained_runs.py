"""Pretrained weights read per slice under NnScalerStrategy, in one process group per rank (``runtime.launch``).

``pretrained_worker`` validates a GPT with ``NnScalerStrategy(recipe, pretrained=file)``, then fits it one step
with a learning rate of 0 (the weights stay the file's) and gathers the state with ``strategy.full_state_dict()``;
the module is built on meta (``trainer.init_module()``) or eagerly from another seed. It reports the validation
loss, the gathered state (rank 0), the bytes each rank read and whether the module stayed on meta.
"""

from __future__ import annotations

import os
from typing import Any

import torch

import lightning_nnscaler as lnn

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_runs import SyncLoggedSteps  # noqa: E402
from lightning_nnscaler.models.gpt import GPT, GPTConfig  # noqa: E402

CONFIG = GPTConfig(vocab_size=64, seq_len=16, hidden=128, layers=4, heads=4, ffn_hidden=512)
"""0.8M parameters, nearly all in the blocks tp splits (the embeddings, LM head and norms, 3%, stay whole)."""
BATCH, BATCHES = 4, 2


class FrozenGPT(SyncLoggedSteps, GPT):
    """The GPT reference with a learning rate of 0: after a fit its weights are still those it started from."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def token_loader(seed: int) -> DataLoader:
    """``BATCHES`` batches of ``BATCH`` samples (tokens, next tokens) of ``CONFIG``, fixed by ``seed``."""
    sequence = torch.randint(0, CONFIG.vocab_size, (BATCH * BATCHES, CONFIG.seq_len + 1), generator=torch.Generator().manual_seed(seed))
    return DataLoader(TensorDataset(sequence[:, :-1].contiguous(), sequence[:, 1:].contiguous()), batch_size=BATCH)


def pretrained_worker(rank: int, world_size: int, runs: list[tuple[str, str, str]], source: str) -> dict[str, Any]:
    """Each ``(name, recipe, init)`` run's ``pretrained_run`` on this rank."""
    torch.set_num_threads(1)  # the ranks share the cores
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    return {name: pretrained_run(recipe, init, world_size, source) for name, recipe, init in runs}


def pretrained_run(recipe: str, init: str, devices: int, source: str) -> dict[str, Any]:
    """Validate, fit one step (learning rate 0) and gather the state, starting from the weights in ``source``."""
    strategy = lnn.NnScalerStrategy(recipe, pretrained=source)
    options = dict(accelerator="cpu", devices=devices, logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer = L.Trainer(strategy=strategy, max_steps=1, num_sanity_val_steps=0, enable_checkpointing=False, **options)
    torch.manual_seed(1)  # other initial weights than the file's
    if init == "meta":
        with trainer.init_module():
            model = FrozenGPT(CONFIG)
    else:
        model = FrozenGPT(CONFIG)
    result: dict[str, Any] = {"val_loss": trainer.validate(model, token_loader(seed=2), verbose=False)[0]["val_loss"]}
    result["bytes_validate"] = strategy.bytes_read
    trainer.fit(model, token_loader(seed=3))
    result["bytes_fit"] = strategy.bytes_read - result["bytes_validate"]
    result["state"] = strategy.full_state_dict()
    result["on_meta"] = any(parameter.is_meta for parameter in model.parameters())
    return result
