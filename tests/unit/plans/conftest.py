"""Fixtures of the recipe tests."""

from __future__ import annotations

import pytest
from plans_support import Traced, traced



@pytest.fixture(autouse=True)
def single_thread(one_thread: None) -> None:
    """Every recipe test runs on one intra-op thread (see tests/conftest.py)."""


@pytest.fixture
def gpt() -> Traced:
    """GPTConfig.small() (2 layers, 4 heads, 16 tokens) at batch 4."""
    return traced("gpt", 4)
