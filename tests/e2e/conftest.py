"""Fixtures of the Trainer tests."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank_group():
    """A test that starts a one-rank process group in this process: it is destroyed afterwards and the environment restored."""
    environment = dict(os.environ)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environment)
