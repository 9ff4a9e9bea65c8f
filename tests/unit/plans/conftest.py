"""Fixtures of the recipe tests."""

from __future__ import annotations

import pytest
import torch
from plans_support import Traced, traced


@pytest.fixture(autouse=True)
def one_thread():
    """The graphs run many tiny kernels: a second intra-op thread only spins (4-10x slower on 2 busy cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def gpt() -> Traced:
    """GPTConfig.small() (2 layers, 4 heads, 16 tokens) at batch 4."""
    return traced("gpt", 4)
