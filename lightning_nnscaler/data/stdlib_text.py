"""Byte-level language-modelling data from the standard library's ``.py`` files.

Every Python installation ships its standard library's source, so this corpus is real text that
needs no download. Files are the top-level ``*.py`` modules of ``sysconfig.get_paths()["stdlib"]``,
sorted by name; a file goes to validation when the CRC-32 of its name is 0 mod ``validation_every``
(a split by file, so no validation window overlaps a training file, and the same on every rank and
every run). Tokens are bytes (vocabulary 256).
"""

from __future__ import annotations

import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import Dataset

VOCAB_SIZE = 256
"""Byte tokens."""
SEPARATOR = b"\n\n"
"""Between two files in the concatenated text."""


def stdlib_files(limit: int | None = None) -> list[Path]:
    """The standard library's top-level ``.py`` files, sorted by name (the first ``limit`` when given)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"), key=lambda path: path.name)
    if not files:
        raise FileNotFoundError("no .py files in the standard library folder (sysconfig.get_paths()['stdlib']): a Python without its source")
    return files[:limit] if limit else files


@dataclass(frozen=True)
class TextSplits:
    """The training and validation text as byte tensors (uint8)."""

    train: Tensor
    validation: Tensor


def load_stdlib_text(*, validation_every: int = 10, max_files: int | None = None) -> TextSplits:
    """Read the standard library's source and split it by file (see the module docstring).

    Args:
        validation_every: one file in about this many goes to validation (by name hash).
        max_files: read only the first files (sorted by name); None reads all of them.
    """
    if validation_every < 2:
        raise ValueError(f"data.validation_every must be at least 2, got {validation_every}")
    train: list[bytes] = []
    validation: list[bytes] = []
    for path in stdlib_files(max_files):
        held_out = zlib.crc32(path.name.encode()) % validation_every == 0
        (validation if held_out else train).append(path.read_bytes())
    if not train or not validation:
        raise ValueError(f"data.max_files={max_files} leaves {'no training' if not train else 'no validation'} file: read more files")
    return TextSplits(_bytes_tensor(SEPARATOR.join(train)), _bytes_tensor(SEPARATOR.join(validation)))


def _bytes_tensor(text: bytes) -> Tensor:
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


class ByteWindows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` bytes: (tokens (T,), targets (T,)) int64, targets shifted by one."""

    def __init__(self, text: Tensor, seq_len: int, limit: int | None = None) -> None:
        count = (len(text) - 1) // seq_len
        if count < 1:
            raise ValueError(f"data.seq_len={seq_len} is longer than the text ({len(text)} bytes)")
        self.text = text
        self.seq_len = seq_len
        self.count = min(count, limit) if limit else count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = index * self.seq_len
        window = self.text[start : start + self.seq_len + 1].long()  # (T + 1,)
        return window[:-1], window[1:]


def encode(text: str) -> Tensor:
    """UTF-8 bytes of ``text`` as token ids (1-D int64)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(tokens: Tensor) -> str:
    """Token ids back to text (invalid UTF-8 sequences replaced)."""
    return bytes(int(token) for token in tokens.tolist()).decode("utf-8", errors="replace")
