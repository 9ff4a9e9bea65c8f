"""DataLoaders of the training app: byte text of the standard library, or the model's own example batches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_nnscaler.app.config import ConfigError, DataConfig
from lightning_nnscaler.data import ByteWindows, load_stdlib_text
from lightning_nnscaler.data.stdlib_text import VOCAB_SIZE


@dataclass
class Loaders:
    """The training and validation loaders; ``steps_per_epoch`` is per data-parallel replica."""

    train: DataLoader
    validation: DataLoader
    steps_per_epoch: int


def build_loaders(data: DataConfig, module: Any, batch_size: int, replicas: int, seed: int) -> Loaders:
    """Loaders with ``batch_size`` samples per replica (``replicas`` data-parallel replicas share the data).

    Raises:
        ConfigError: the model cannot take this data (naming ``data`` and ``model``).
    """
    if data.kind == "stdlib_text":
        train, validation = _text(data, module)
    else:
        train, validation = _synthetic(data, module, seed)
    validation_rows = min(len(validation), data.validation_batches * batch_size * replicas)
    validation = torch.utils.data.Subset(validation, range(validation_rows))
    steps = len(train) // (batch_size * replicas)
    if steps < 1:
        raise ConfigError(f"batch_size={batch_size} x {replicas} replicas is more than the {len(train)} training samples of data={data.kind}")
    # drop_last: every batch has the planned shape (a ragged batch would be planned again)
    return Loaders(
        DataLoader(train, batch_size=batch_size, shuffle=True, drop_last=True),
        DataLoader(validation, batch_size=batch_size, shuffle=False, drop_last=True),
        steps,
    )


def model_seq_len(data: DataConfig, module: Any) -> int:
    """``data.seq_len``, or the model's ``config.seq_len`` when null."""
    seq_len = data.seq_len or getattr(getattr(module, "config", None), "seq_len", None)
    if not isinstance(seq_len, int):
        raise ConfigError(f"data.seq_len is null and {type(module).__name__} has no config.seq_len: set data.seq_len")
    return seq_len


def _text(data: DataConfig, module: Any) -> tuple[Dataset, Dataset]:
    vocab = getattr(getattr(module, "config", None), "vocab_size", None)
    if not isinstance(vocab, int) or vocab < VOCAB_SIZE or not hasattr(module, "config") or not hasattr(module.config, "seq_len"):
        raise ConfigError(
            f"data=stdlib_text feeds byte tokens (tokens, targets) to a language model with config.vocab_size >= {VOCAB_SIZE} "
            f"and config.seq_len; {type(module).__name__} is not one: use data=synthetic (the model's example_batch)"
        )
    seq_len = model_seq_len(data, module)
    if seq_len > module.config.seq_len:
        raise ConfigError(f"data.seq_len={seq_len} is longer than model.config.seq_len={module.config.seq_len}")
    splits = load_stdlib_text(validation_every=data.validation_every, max_files=data.max_files)
    return ByteWindows(splits.train, seq_len), ByteWindows(splits.validation, seq_len)


def _synthetic(data: DataConfig, module: Any, seed: int) -> tuple[Dataset, Dataset]:
    if not hasattr(module, "example_batch"):
        raise ConfigError(f"data=synthetic draws batches from the model's example_batch(batch_size, generator); {type(module).__name__} has none")

    def draw(samples: int, offset: int) -> Dataset:
        batch = module.example_batch(samples, torch.Generator().manual_seed(seed + offset))
        return TensorDataset(*batch)

    return draw(data.train_samples, 0), draw(data.validation_samples, 1)
