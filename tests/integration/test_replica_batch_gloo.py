"""``strategy.planning.gather_replica_batch`` on 4 real gloo ranks: each rank loads its own rows (ddp's layout,
as ``auto`` loads) and gets the rows of its replica under a dp 2 × tp 2 plan, in order."""

from __future__ import annotations

import torch
import torch.distributed as dist

from support.ranks import launch_ranks

from lightning_nnscaler.plans.layout import DeviceGrid, RecipeLayout, data_parallel_layout
from lightning_nnscaler.strategy.planning import gather_replica_batch

ROWS_PER_RANK = 3


def all_gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    return gathered


def replica_rows(rank: int, world_size: int) -> tuple[list[int], list[int]]:
    """This rank's rows of the whole batch under dp 2 × tp 2: token rows (int64) and a float input's."""
    first = rank * ROWS_PER_RANK
    loaded = {"tokens": torch.arange(first, first + ROWS_PER_RANK).view(-1, 1).repeat(1, 4),
              "weights": torch.arange(first, first + ROWS_PER_RANK, dtype=torch.float32)}
    rows = gather_replica_batch(loaded, data_parallel_layout(world_size, {}), RecipeLayout(DeviceGrid.of(dp=2, tp=2)), rank, all_gather)
    return rows["tokens"][:, 0].tolist(), rows["weights"].long().tolist()


def test_each_rank_gets_its_replicas_rows_from_the_ranks_that_loaded_them() -> None:
    by_rank = launch_ranks(replica_rows, 4, timeout=60.0)
    first_replica, second_replica = list(range(6)), list(range(6, 12))
    assert by_rank == [(first_replica, first_replica)] * 2 + [(second_replica, second_replica)] * 2
