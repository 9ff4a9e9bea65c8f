"""Batches per data-parallel replica, as under ddp: an unchanged ddp script trains the same under
``nnscaler`` (dp) and ``nnscaler_zero3``; under ``nnscaler_tp`` the ranks of the one replica load the
same samples. Every run is the same script (`batch_runs.ddp_style_fit`), only ``strategy`` changes."""

from __future__ import annotations

import pytest
import torch

from support.ranks import launch_ranks

from batch_runs import REPLICA_BATCH, STEPS, batches_worker  # noqa: E402 - tests/e2e is on sys.path

STRATEGIES = ["ddp", "nnscaler", "nnscaler_zero3", "nnscaler_tp", "nnscaler_user_tp"]


@pytest.fixture(scope="module")
def results() -> list[dict[str, dict]]:
    return launch_ranks(batches_worker, 2, STRATEGIES, timeout=280)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["nnscaler", "nnscaler_zero3"])
def test_a_ddp_script_trains_the_same_under_data_parallel_recipes(results, strategy) -> None:
    for rank in (0, 1):
        ddp, ours = results[rank]["ddp"], results[rank][strategy]
        assert ours["sampler"] == ddp["sampler"] == {"num_replicas": 2, "rank": rank}
        assert ours["batches"] == ddp["batches"]  # the same samples on every rank, every step
        assert len(ours["logged"]) == STEPS
        torch.testing.assert_close(torch.tensor(ours["logged"]), torch.tensor(ddp["logged"]), rtol=1e-5, atol=1e-6)
    assert results[0]["ddp"]["batches"][0] != results[1]["ddp"]["batches"][0]  # two replicas: different samples


@pytest.mark.timeout(300)
def test_tensor_parallel_ranks_load_the_same_samples(results) -> None:
    rank0, rank1 = results[0]["nnscaler_tp"], results[1]["nnscaler_tp"]
    assert rank0["sampler"] == rank1["sampler"] == {"num_replicas": 1, "rank": 0}
    assert rank0["batches"] == rank1["batches"]
    assert all(len(batch) == REPLICA_BATCH for batch in rank0["batches"])  # the global batch is one replica's
    assert rank0["logged"] == rank1["logged"]


@pytest.mark.timeout(300)
def test_a_registered_recipe_trains_under_its_strategy_name(results) -> None:
    """``batch_runs.user_tp`` (registered with ``lnn.register_recipe``, default layout: one replica)
    trains as the built-in tp does: the same samples on both ranks, the same logged losses."""
    for rank in (0, 1):
        ours, built_in = results[rank]["nnscaler_user_tp"], results[rank]["nnscaler_tp"]
        assert ours["sampler"] == {"num_replicas": 1, "rank": 0}
        assert ours["batches"] == built_in["batches"]
        torch.testing.assert_close(torch.tensor(ours["logged"]), torch.tensor(built_in["logged"]), rtol=1e-5, atol=1e-6)
