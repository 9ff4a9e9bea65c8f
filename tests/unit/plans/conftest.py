"""Fixtures of the recipe tests."""

from __future__ import annotations

import pytest
import torch
from plans_support import Traced, traced

from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.plans import catalog


@pytest.fixture(autouse=True)
def single_thread(one_thread: None) -> None:
    """Every recipe test runs on one intra-op thread (see tests/conftest.py)."""


@pytest.fixture
def gpt() -> Traced:
    """GPTConfig.small() (2 layers, 4 heads, 16 tokens) at batch 4."""
    return traced("gpt", 4)


@pytest.fixture
def gpt_model() -> tuple[GPT, tuple[torch.Tensor, torch.Tensor]]:
    """An untraced GPTConfig.small() and a batch of 2 (for ``lnn.parallelize``)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.small())
    return model, model.example_batch(2, torch.Generator().manual_seed(1))


@pytest.fixture(autouse=True)
def restore_catalog() -> None:
    """Recipes a test registers are gone after it (the catalog is process-wide)."""
    registered = dict(catalog._REGISTRY)
    yield
    catalog._REGISTRY.clear()
    catalog._REGISTRY.update(registered)
