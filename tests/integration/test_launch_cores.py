"""``launch(..., bind_cores=True)`` gives each rank a core of its own, the backend's threads included; with more
ranks than cores it binds none (``rank_cores``)."""

from __future__ import annotations

import os

import pytest

from lightning_nnscaler.launch import rank_cores
from support.ranks import launch_ranks

from workers import thread_cores  # noqa: E402 - tests/integration is on sys.path


def test_each_rank_gets_the_next_core_this_process_may_use() -> None:
    cores = sorted(os.sched_getaffinity(0))
    assert rank_cores(len(cores)) == [{core} for core in cores]
    assert rank_cores(1) == [{cores[0]}]


def test_more_ranks_than_cores_are_not_bound() -> None:
    assert rank_cores(len(os.sched_getaffinity(0)) + 1) is None


@pytest.mark.timeout(120)
def test_a_bound_ranks_threads_all_run_on_its_core() -> None:
    world_size = min(2, len(os.sched_getaffinity(0)))
    per_rank = launch_ranks(thread_cores, world_size, timeout=100, bind_cores=True)
    expected = rank_cores(world_size)
    assert expected is not None
    for rank, threads in enumerate(per_rank):
        assert len(threads) > 1  # gloo's threads, started with the group after the rank was bound
        assert all(cores == expected[rank] for cores in threads), (rank, threads)


@pytest.mark.timeout(120)
def test_unbound_ranks_may_run_anywhere_the_caller_may() -> None:
    per_rank = launch_ranks(thread_cores, 2, timeout=100)
    assert all(cores == os.sched_getaffinity(0) for threads in per_rank for cores in threads)
