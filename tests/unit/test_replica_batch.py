"""``strategy.planning.gather_replica_batch``: the rows a rank's code reads when the plan's replicas are
not the DataLoader's (``auto`` loads as ddp does, its winner may be tp, a pipeline or a hybrid)."""

from __future__ import annotations

import pytest
import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.plans.layout import DeviceGrid, RecipeLayout, data_parallel_layout, single_replica
from lightning_nnscaler.strategy.planning import gather_replica_batch, reads_other_rows

WORLD = 4
ROWS_PER_RANK = 3


def loaded_by_rank() -> list[dict[str, torch.Tensor]]:
    """Each rank's DataLoader batch under ddp's layout: its own 3 rows, numbered by their place in the whole batch."""
    return [
        {"tokens": torch.arange(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK).repeat_interleave(2).view(-1, 2), "scale": torch.tensor(2.0)}
        for rank in range(WORLD)
    ]


def gathered(reading: RecipeLayout) -> list[dict[str, torch.Tensor]]:
    """Every rank's rows under ``reading``, gathered from ``loaded_by_rank`` (ddp's layout)."""
    batches = loaded_by_rank()

    def all_gather(tensor: torch.Tensor) -> list[torch.Tensor]:  # in-memory ranks: the one batched input
        return [batch["tokens"] for batch in batches]

    return [gather_replica_batch(batches[rank], data_parallel_layout(WORLD, {}), reading, rank, all_gather) for rank in range(WORLD)]


def rows(batch: dict[str, torch.Tensor]) -> list[int]:
    return batch["tokens"][:, 0].tolist()


def test_a_plan_of_one_replica_reads_the_whole_batch_on_every_rank() -> None:
    for batch in gathered(single_replica(WORLD, {})):
        assert rows(batch) == list(range(WORLD * ROWS_PER_RANK))
        assert batch["scale"].item() == 2.0  # a 0-d input is every rank's own


def test_a_hybrid_plan_reads_its_replicas_rows_gathered_from_the_ranks_that_loaded_them() -> None:
    hybrid = RecipeLayout(DeviceGrid.of(dp=2, tp=2))  # replicas {0, 1} and {2, 3}
    by_rank = [rows(batch) for batch in gathered(hybrid)]
    assert by_rank == [[0, 1, 2, 3, 4, 5]] * 2 + [[6, 7, 8, 9, 10, 11]] * 2


def test_only_a_plan_grouping_the_ranks_otherwise_needs_the_gather() -> None:
    loading = data_parallel_layout(WORLD, {})
    assert not reads_other_rows(loading, data_parallel_layout(WORLD, {}), WORLD)
    assert reads_other_rows(loading, single_replica(WORLD, {}), WORLD)
    assert reads_other_rows(loading, RecipeLayout(DeviceGrid.of(dp=2, pp=2)), WORLD)


@pytest.mark.parametrize("world", [2, 4])
def test_auto_loads_the_batch_per_rank_as_ddp_does(world: int) -> None:
    """The DataLoader is built before the search: auto's layout is ddp's, whatever plan then wins."""
    layout = lnn.load_recipe("auto").layout(world, {})
    assert layout.data_parallel == world
    assert [layout.replica(rank) for rank in range(world)] == list(range(world))
