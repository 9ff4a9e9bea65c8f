"""V-shaped schedules (issue 38): ZB-V and V-Half (Qi et al. 2024), p ranks, 2p stages, rank r holds r and 2p - 1 - r.

Units: ``metrics.bubble_fraction`` with its default ``Durations`` (F = B = W = 1; 1F1B's fused B = 2).
Activations: ``metrics.peak_in_flight`` (a stage's stash held from F to its last backward half); a V
stage holds half the layers of a 1F1B stage, so it counts 1/2 against 1F1B's 1.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.plans.pipeline import stage_cost
from lightning_nnscaler.schedules.metrics import SPLIT_SHARE, WEIGHT_SHARE
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.schedules.actions import B, F, W, Action
from lightning_nnscaler.schedules import (
    bubble_fraction, execute, format_csv, load_csv, lower, one_f_one_b, peak_in_flight, v_half, validate, zbv,
)

CASES = [(ranks, microbatches) for ranks in (2, 4) for microbatches in (1, 2, 3, 4, 8, 12)]


def v_activation_peak(schedule) -> float:
    """The largest per-rank stash, in 1F1B-stage units (a V stage is half a 1F1B stage)."""
    return max(peak_in_flight(schedule)) / 2


@pytest.mark.parametrize("generator", [zbv, v_half])
@pytest.mark.parametrize(("ranks", "microbatches"), CASES)
def test_v_schedules_place_the_v_and_run_every_action_once_without_deadlock(generator, ranks: int, microbatches: int) -> None:
    schedule = generator(ranks, microbatches)
    assert schedule.stage_ranks == tuple(min(stage, 2 * ranks - 1 - stage) for stage in range(2 * ranks))
    validate(lower(schedule))  # no deadlock, no crossed messages
    for rank, rank_actions in enumerate(schedule.actions):
        expected = {(stage, microbatch, kind) for stage in (rank, 2 * ranks - 1 - rank) for microbatch in range(microbatches) for kind in (F, B, W)}
        assert sorted((a.stage, a.microbatch, a.kind) for a in rank_actions) == sorted(expected)


@pytest.mark.parametrize(("ranks", "microbatches"), CASES)
def test_zbv_has_less_bubble_than_1f1b_and_no_more_activations(ranks: int, microbatches: int) -> None:
    reference = one_f_one_b(ranks, microbatches)
    schedule = zbv(ranks, microbatches)
    assert bubble_fraction(schedule) < bubble_fraction(reference)
    assert v_activation_peak(schedule) <= max(peak_in_flight(reference))


@pytest.mark.parametrize(("ranks", "microbatches"), [(ranks, m) for ranks, m in CASES if m >= ranks])
def test_v_half_keeps_at_most_six_tenths_of_1f1b_activations(ranks: int, microbatches: int) -> None:
    reference = one_f_one_b(ranks, microbatches)
    assert v_activation_peak(v_half(ranks, microbatches)) <= 0.6 * max(peak_in_flight(reference))


def test_measured_bubbles_and_peaks() -> None:
    measured = {(name, p, m): (round(bubble_fraction(gen(p, m)), 3), v_activation_peak(gen(p, m)))
                for name, gen in (("zbv", zbv), ("vhalf", v_half)) for p, m in ((2, 8), (4, 8), (4, 16))}
    assert measured == {
        ("zbv", 2, 8): (0.04, 2.0), ("zbv", 4, 8): (0.059, 4.0), ("zbv", 4, 16): (0.03, 4.0),
        ("vhalf", 2, 8): (0.333, 1.0), ("vhalf", 4, 8): (0.342, 2.0), ("vhalf", 4, 16): (0.338, 2.0),
    }  # 1F1B: (0.111, 2), (0.273, 4), (0.158, 4)


MEASURED_MS = {  # (stage, kind) -> ms: a ZB-V step of benchmarks/pipeline.py's GPT on 2 gloo CPU ranks
    (0, F): 6.9, (0, B): 0.2, (0, W): 14.1, (1, F): 6.6, (1, B): 7.9, (1, W): 7.6,
    (2, F): 6.6, (2, B): 8.5, (2, W): 7.6, (3, F): 7.8, (3, B): 8.9, (3, W): 8.4,
}


def measured(action) -> float:
    return MEASURED_MS[action.stage, action.kind]


def makespan(schedule, cost) -> float:
    return execute(schedule, lambda action: cost(action) if action.kind.is_compute else 0.0).makespan


@pytest.mark.parametrize("generator", [zbv, v_half])
def test_in_unit_time_a_cost_changes_nothing(generator) -> None:
    for p, m in ((2, 8), (4, 8), (4, 16)):
        assert generator(p, m, cost=lambda action: 1.0) == generator(p, m)


@pytest.mark.parametrize("generator", [zbv, v_half])
@pytest.mark.parametrize("cost", [measured, stage_cost(((0, 0.27), (1, 0.22), (2, 0.23), (3, 0.28)))], ids=["measured", "stage cost"])
def test_an_order_made_in_stage_time_ends_no_later_and_keeps_the_memory_limit(generator, cost) -> None:
    timed, unit = generator(2, 8, cost=cost), generator(2, 8)
    validate(lower(timed))
    assert makespan(timed, cost) <= makespan(unit, cost)
    assert max(peak_in_flight(timed)) <= max(peak_in_flight(unit))


def test_zbv_made_in_the_measured_times_of_a_step_idles_less_than_the_paper_order() -> None:
    busy = 8 * sum(MEASURED_MS.values())
    bubbles = [1 - busy / (2 * makespan(schedule, measured)) for schedule in (zbv(2, 8), zbv(2, 8, cost=measured))]
    assert [round(bubble, 3) for bubble in bubbles] == [0.086, 0.039]  # F = B = W: 0.040


def test_stage_cost_gives_the_first_stage_no_input_gradient_work_and_splits_the_others_as_the_simulator() -> None:
    cost = stage_cost(((0, 0.3), (1, 0.3), (2, 0.6)))
    assert [cost(Action(0, 0, kind)) for kind in (F, B, W)] == pytest.approx([0.1, 0.0, 0.2])
    assert [cost(Action(2, 5, kind)) for kind in (F, B, W)] == pytest.approx([0.2, 0.4 * SPLIT_SHARE, 0.4 * WEIGHT_SHARE])


def test_an_order_made_in_estimated_stage_time_idles_less_in_measured_times() -> None:
    """The benchmark GPT's ZB-V plan at 2 ranks, cut by estimate (its stage shares below), replayed in the op times
    measured on one of its steps: the split's extra W and stage 0's empty B, known before running, save 3 points."""
    timed = zbv(2, 8, cost=stage_cost(((0, 0.245), (1, 0.245), (2, 0.245), (3, 0.265))))
    busy = 8 * sum(MEASURED_MS.values())
    bubbles = [1 - busy / (2 * makespan(schedule, measured)) for schedule in (zbv(2, 8), timed)]
    assert [round(bubble, 3) for bubble in bubbles] == [0.086, 0.052]


def gpt_and_batch(layers: int = 2) -> tuple[GPT, object]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, seq_len=16, hidden=32, layers=layers, heads=4))  # small(), one layer per V stage
    return model, model.example_batch(8, torch.Generator().manual_seed(0))


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(("schedule", "generator"), [("zbv", zbv), ("vhalf", v_half)])
def test_a_gpt_planned_with_a_v_schedule_name_verifies(schedule: str, generator, world_size: int) -> None:
    """The zbv and vhalf catalog recipes, a stage per layer: with cuts inside a layer a residual tensor skips a stage
    and its gradient is one more message between two ranks, whose order the generators do not model."""
    model, batch = gpt_and_batch(2 * world_size)  # whole layers per stage: no tensor skips a stage
    plan = lnn.parallelize(model, batch, schedule, world_size, step="training_step", microbatches=4,
                           layers_per_stage=",".join(["1"] * 2 * world_size))
    assert plan.verify().parameters_checked == len(list(model.parameters()))
    made_in_stage_time = generator(world_size, 4, cost=stage_cost(plan.pipeline.stage_work))
    assert plan.pipeline.schedule == made_in_stage_time
    assert [[str(action) for action in actions if action.kind.is_compute] for actions in plan.program.actions] == made_in_stage_time.as_text()
    assert all("PROGRAM = [" in source for source in plan.sources)


def test_a_zbv_table_runs_as_schedule_csv(tmp_path: Path) -> None:
    path = tmp_path / "zbv.csv"
    path.write_text(format_csv(zbv(2, 4)))
    assert load_csv(path) == zbv(2, 4)
    model, batch = gpt_and_batch()
    plan = lnn.parallelize(model, batch, "zb1", 2, step="training_step", schedule_csv=str(path))
    plan.verify()
    assert plan.pipeline.schedule.stage_ranks == (0, 1, 1, 0)
