"""The two engines agree where both apply, and the analytic 1024-rank plan is well formed."""

from __future__ import annotations

import random

import pytest

from lightning_nnscaler.schedules import interleaved, lower, one_f_one_b, zb1
from lightning_nnscaler.sim import CommModel, Machine, load_spec, simulate
from lightning_nnscaler.sim.analytic import TransformerShape, transformer_task_lists
from lightning_nnscaler.sim.tasks import Collective, Compute, Recv, Send, WaitCollectives


def random_lists(schedule, seed: int) -> list[list]:
    """The schedule's actions with random durations and sizes, a blocking and a background collective at the end."""
    rng = random.Random(seed)
    everyone = tuple(range(schedule.world_size))
    lists = []
    for rank_actions in lower(schedule).actions:
        tasks = []
        for action in rank_actions:
            if action.kind.is_compute:
                tasks.append(Compute(rng.uniform(0.5, 2.0), action.kind.value, activation_bytes=rng.randint(1, 9)))
            elif action.kind.is_send:
                tasks.append(Send(action.peer, rng.randint(1, 10**6)))
            else:
                tasks.append(Recv(action.peer))
        tasks += [Collective("all_reduce", everyone, 10**6, blocking=False), Compute(0.3, "optimizer"),
                  Collective("all_gather", everyone, 10**5), WaitCollectives()]
        lists.append(tasks)
    return lists


@pytest.mark.parametrize("schedule", [one_f_one_b(4, 8), interleaved(2, 2, 4), zb1(3, 6)], ids=["1f1b", "interleaved", "zb1"])
@pytest.mark.parametrize("seed", [0, 1])
def test_list_scheduling_and_the_event_heap_give_the_same_times(schedule, seed: int) -> None:
    lists = random_lists(schedule, seed)
    comm = CommModel(load_spec("a100"))
    fast = simulate(lists, comm, Machine(ranks_per_node=8))
    events = simulate(lists, comm, Machine(ranks_per_node=8, cores_per_node=10**6))  # cores to spare: no slow-down
    assert fast.step_seconds == pytest.approx(events.step_seconds)
    for mine, theirs in zip(fast.ranks, events.ranks, strict=True):
        assert (mine.busy, mine.communication, mine.end) == pytest.approx((theirs.busy, theirs.communication, theirs.end))


def test_the_analytic_plan_simulates_with_a_pipeline_bubble() -> None:
    spec = load_spec("a100")
    shape = TransformerShape(layers=8, hidden=1024, seq_len=512, global_batch=32)
    lists = transformer_task_lists(shape, spec, dp=2, tp=2, pp=4)
    result = simulate(lists, CommModel(spec), Machine(spec.ranks_per_node))
    assert len(lists) == 16
    microbatches = 32 // 2
    assert 0.5 * (4 - 1) / (microbatches + 3) < result.bubble_fraction < 0.5
    assert result.ranks[0].peak_activation_bytes == 4 * result.ranks[-1].peak_activation_bytes  # 1F1B: p - stage in flight
