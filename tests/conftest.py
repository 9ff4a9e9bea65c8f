"""Shared pytest setup: importing the package first keeps torchvision importable (see _compat).

The suite runs on two pytest-xdist workers (``-n 2 --dist loadgroup`` in pyproject.toml): the tests
that start processes (``tests/e2e``, ``tests/integration``: each rank a process, together they use
the cores) run one after another on one worker, in the ``processes`` group, while the other worker
takes the single-process unit tests.
"""

import lightning_nnscaler  # noqa: F401
import pytest
import torch


@pytest.fixture
def one_thread():
    """Many tiny kernels, or many virtual ranks on 2 cores: more intra-op threads only contend (4-10x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


PROCESS_TESTS = ("e2e", "integration")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups in its own hook
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put every test that starts rank processes in one xdist group (one worker runs them in turn)."""
    for item in items:
        if any(part in PROCESS_TESTS for part in item.path.parts[-3:-1]):
            item.add_marker(pytest.mark.xdist_group("processes"))
