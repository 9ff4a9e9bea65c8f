"""V-shaped schedules (issue 38): ZB-V and V-Half (Qi et al. 2024), p ranks, 2p stages, rank r holds r and 2p - 1 - r.

Units: ``metrics.bubble_fraction`` with its default ``Durations`` (F = B = W = 1; 1F1B's fused B = 2).
Activations: ``metrics.peak_in_flight`` (a stage's stash held from F to its last backward half); a V
stage holds half the layers of a 1F1B stage, so it counts 1/2 against 1F1B's 1.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.materialize.kept import KeptBytes
from lightning_nnscaler.materialize.program import Compute
from lightning_nnscaler.plans import pipeline as planning, stage_memory
from lightning_nnscaler.plans.context import PlanContext
from lightning_nnscaler.plans.pipeline import PipelineSettings, pipeline, stage_cost
from lightning_nnscaler.schedules.metrics import SPLIT_SHARE, WEIGHT_SHARE
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.schedules.actions import B, F, W, Action
from lightning_nnscaler.schedules.v_shape import one_f_one_b_peak
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
    # at 8 ranks admitting a microbatch only where every deeper rank has room for it when it arrives idles less (was 0.103)
    assert (round(bubble_fraction(zbv(8, 16)), 3), v_activation_peak(zbv(8, 16))) == (0.086, 8.0)


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


def byte_peaks(schedule, saved) -> list[float]:
    """Per rank, the most of ``saved`` (per stage and microbatch) alive at once: a stage's from its F to its W."""
    peaks = []
    for rank_actions in schedule.actions:
        alive = peak = 0.0
        for action in rank_actions:
            alive += saved[action.stage] if action.kind is F else -saved[action.stage] if action.kind is W else 0.0
            peak = max(peak, alive)
        peaks.append(peak)
    return peaks


@pytest.mark.parametrize(("generator", "share"), [(zbv, lambda p: 1.0), (v_half, lambda p: max(p, 2) / (2 * p))], ids=["zbv", "vhalf"])
def test_a_limit_in_saved_bytes_holds_on_every_rank_whatever_each_stage_keeps(generator, share) -> None:
    """ZB-V keeps 1F1B's peak on the same layers, V-Half half of it, in bytes; a rank holding nothing may always take
    one microbatch (else a stage larger than the limit could never run)."""
    rng = random.Random(0)
    for _ in range(40):
        p, m = rng.choice((2, 3, 4)), rng.choice((1, 4, 8))
        saved = [rng.choice((0.5, 1.0, 1.0, 2.0, 4.0)) for _ in range(2 * p)]
        cost = stage_cost(tuple((stage, rng.uniform(0.5, 1.5)) for stage in range(2 * p)))
        for schedule in (generator(p, m, saved=saved), generator(p, m, cost=cost, saved=saved)):
            validate(lower(schedule))
            one_microbatch = max(saved[rank] + saved[2 * p - 1 - rank] for rank in range(p))
            assert max(byte_peaks(schedule, saved)) <= max(share(p) * one_f_one_b_peak(saved), one_microbatch) + 1e-9


@pytest.mark.parametrize("generator", [zbv, v_half])
def test_stages_that_keep_alike_give_the_order_counted_in_stages(generator) -> None:
    for p, m in ((2, 8), (4, 8), (4, 16)):
        assert generator(p, m, saved=[3.5] * (2 * p)) == generator(p, m)


BENCHMARK_GPT_SAVED = (32.07, 32.06, 32.06, 36.08)  # MiB per batch: benchmarks/pipeline.py's GPT cut into 4 V stages (the head on 3)
BENCHMARK_GPT_COST = stage_cost(((0, 0.245), (1, 0.245), (2, 0.245), (3, 0.265)))


def test_counted_in_bytes_zbv_keeps_1f1b_peak_where_the_heads_stage_keeps_more_at_the_cost_of_bubble() -> None:
    """Counted in stages, rank 0 holds two microbatches of stages 0 and 3 (the head's): 6 % above 1F1B's peak. Counted
    in bytes, a second one would not fit with its return, so rank 0 holds one: within the peak, and more bubble."""
    limit = one_f_one_b_peak(BENCHMARK_GPT_SAVED)
    busy = 8 * sum(BENCHMARK_GPT_COST(Action(stage, 0, kind)) for stage in range(4) for kind in (F, B, W))
    rows = {}
    for name, saved in (("stages", None), ("bytes", BENCHMARK_GPT_SAVED)):
        schedule = zbv(2, 8, cost=BENCHMARK_GPT_COST, saved=saved)
        rows[name] = (round(max(byte_peaks(schedule, BENCHMARK_GPT_SAVED)) / limit, 3), round(1 - busy / (2 * makespan(schedule, BENCHMARK_GPT_COST)), 3))
    assert rows == {"stages": (1.063, 0.036), "bytes": (1.0, 0.065)}  # 1F1B in these times: bubble 0.111


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(("schedule", "generator"), [("zbv", zbv), ("vhalf", v_half)])
def test_a_gpt_planned_with_a_byte_limit_verifies_and_counts_what_its_segments_keep(monkeypatch, schedule: str, generator, world_size: int) -> None:
    """``activation_limit="bytes"``: the order is made in the bytes each stage saves, estimated on the captured graph,
    which match what the materialized program's segments keep (``materialize.kept``, as explain counts) within 1 %."""
    estimated: list[tuple[int, ...]] = []
    monkeypatch.setattr(planning, "stage_saved_bytes", lambda *args: estimated.append(stage_memory.stage_saved_bytes(*args)) or estimated[-1])
    model, batch = gpt_and_batch(2 * world_size)
    plan = lnn.parallelize(model, batch, schedule, world_size, step="training_step", microbatches=4,
                           layers_per_stage=",".join(["1"] * 2 * world_size), activation_limit="bytes")
    assert plan.verify().parameters_checked == len(list(model.parameters()))
    saved = estimated[-1]
    assert plan.pipeline.schedule == generator(world_size, 4, cost=stage_cost(plan.pipeline.stage_work), saved=saved)
    program = plan.materialized
    trained = {group.name for group in program.gradient_groups}
    kept: dict[tuple[int, int], int] = {}
    for rank in range(world_size):
        counter = KeptBytes(program.ranks[rank], trained.__contains__)
        for action in program.ranks[rank].actions:
            counter.follow(action)
            if isinstance(action, Compute) and action.segment[0] >= 0:
                kept[action.segment] = kept.get(action.segment, 0) + counter.kept(action)
    assert [kept[stage, 0] for stage in range(2 * world_size)] == pytest.approx([bytes_ / 4 for bytes_ in saved], rel=0.01)


@pytest.mark.parametrize(
    ("schedule", "options", "message"),
    [
        ("zbv", {"activation_limit": "byte"}, r"zbv: activation_limit must be one of \('stages', 'bytes'\), got 'byte'"),
        ("dualpipev", {"activation_limit": "bytes"}, r"recipe 'dualpipev': unknown parameter 'activation_limit'"),
        ("1f1b", {"activation_limit": "bytes"}, r"recipe '1f1b': unknown parameter 'activation_limit'"),
    ],
)
def test_an_activation_limit_the_schedule_cannot_keep_is_refused_naming_the_key(schedule: str, options: dict, message: str) -> None:
    model, batch = gpt_and_batch(4)
    with pytest.raises((ValueError, TypeError), match=message):
        lnn.parallelize(model, batch, schedule, 2, step="training_step", microbatches=4, **options)


@pytest.mark.parametrize(
    ("schedule", "settings", "message"),
    [
        ("1f1b", PipelineSettings(activation_limit="bytes"), r"1f1b: activation_limit='bytes' is for zbv and vhalf, whose order keeps a memory limit"),
        ("zbv", PipelineSettings(activation_limit="bytes", schedule_csv="unused.csv"),
         r"zbv: activation_limit='bytes' orders the generator's actions; schedule_csv fixes the order: give one of them"),
    ],
)
def test_pipeline_settings_with_an_activation_limit_no_order_keeps_are_refused(schedule: str, settings: PipelineSettings, message: str) -> None:
    model, batch = gpt_and_batch(4)
    with pytest.raises(ValueError, match=message):
        pipeline(lnn.trace(model, batch, step="training_step"), PlanContext(world_size=2), schedule, settings)
