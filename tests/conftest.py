"""Shared pytest setup."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """Many tiny kernels, or many virtual ranks on 2 cores: more intra-op threads only contend (4-10x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

