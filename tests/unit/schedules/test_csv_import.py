"""Importing a per-rank action table in torch.distributed.pipelining's CSV format (issue 38): a schedule from a
paper runs as the pipeline recipes' ``schedule_csv`` after it is parsed, checked and validated."""

from __future__ import annotations

import csv
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.pipelining import schedules as torch_schedules

import lightning_nnscaler as lnn
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.schedules import (
    ScheduleError, dual_pipe_v, format_csv, gpipe, interleaved, load_csv, lower, one_f_one_b, parse_table, zb1,
)

GRID = re.compile(r"^step \| rank 0 +\| rank 1", re.M)


def table(tmp_path: Path, text: str) -> str:
    path = tmp_path / "schedule.csv"
    path.write_text(text)
    return str(path)


def gpt_and_batch() -> tuple[GPT, object]:
    torch.manual_seed(0)
    model = GPT(GPTConfig.small())
    return model, model.example_batch(8, torch.Generator().manual_seed(0))


def scheduled(plan: lnn.Plan) -> list[list[str]]:
    """Each rank's compute actions, in the order of the generated code's ``PROGRAM``."""
    programs = [re.search(r"^PROGRAM = \[.*?\n(.*?)^\]", source, re.M | re.S).group(1) for source in plan.sources]
    texts = [[text.strip() for line in eval(f"[{program}]") for text in line.split(",")] for program in programs]  # noqa: S307 - our literal
    return [[text for text in rank if re.fullmatch(r"\d+[FBW]\d+", text)] for rank in texts]


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_1f1b_table_plans_a_gpt_that_verifies_and_runs_1f1b_order(tmp_path: Path, world_size: int) -> None:
    path = table(tmp_path, format_csv(one_f_one_b(world_size, 4)))
    model, batch = gpt_and_batch()
    plan = lnn.parallelize(model, batch, "1f1b", world_size, step="training_step", schedule_csv=path)
    assert plan.verify().parameters_checked == len(list(model.parameters()))
    assert plan.pipeline.schedule == one_f_one_b(world_size, 4)
    assert scheduled(plan) == one_f_one_b(world_size, 4).as_text()


def test_a_hand_written_gpipe_table_verifies(tmp_path: Path) -> None:
    path = table(tmp_path, "0F0,0F1,0F2,0F3,,,0B0,0B1,0B2,0B3\n,1F0,1F1,1F2,1F3,1B0,1B1,1B2,1B3,\n")
    model, batch = gpt_and_batch()
    plan = lnn.parallelize(model, batch, "gpipe", 2, step="training_step", schedule_csv=path)
    plan.verify()
    assert plan.pipeline.schedule == gpipe(2, 4)


@pytest.mark.parametrize(
    ("recipe", "text", "stage_ranks"),
    [
        ("zb1", format_csv(zb1(2, 4)), (0, 1)),  # I and W cells
        ("1f1b", format_csv(interleaved(2, 2, 4)), (0, 1, 0, 1)),  # two chunks per rank
        ("gpipe", "0F0,0F1,3F0,3F1,3B0,3B1,0B0,0B1\n1F0,1F1,2F0,2F1,2B0,2B1,1B0,1B1\n", (0, 1, 1, 0)),  # a V placement
    ],
    ids=["zb1", "interleaved", "v-shape"],
)
def test_split_backward_and_several_stages_per_rank_import_and_verify(tmp_path: Path, recipe: str, text: str, stage_ranks: tuple) -> None:
    model, batch = gpt_and_batch()
    plan = lnn.parallelize(model, batch, recipe, 2, step="training_step", schedule_csv=table(tmp_path, text))
    plan.verify()
    assert plan.pipeline.schedule.stage_ranks == stage_ranks


def test_generated_tables_read_back_as_their_schedules(tmp_path: Path) -> None:
    for schedule in (one_f_one_b(4, 8), gpipe(2, 4), zb1(4, 8), interleaved(2, 2, 4)):
        assert load_csv(table(tmp_path, format_csv(schedule))) == schedule
    assert "0I0" in format_csv(zb1(2, 2))  # a split backward's B is torch's I
    # torch's compute_comms form (no peers) and ours (with peers) both import; a fused B in a split table is B then W
    lowered = lower(one_f_one_b(2, 4))
    assert parse_table([[re.sub(r"(->|<-)\d+$", "", str(action)) for action in rank] for rank in lowered.actions]) == one_f_one_b(2, 4)
    assert parse_table([[str(action) for action in rank] for rank in lowered.actions]) == one_f_one_b(2, 4)
    fused = parse_table([["0F0", "0F1", "0I0", "0W0", "0B1"], ["1F0", "1I0", "1F1", "1I1", "1W0", "1W1"]])
    assert fused.as_text()[0] == ["0F0", "0F1", "0B0", "0W0", "0B1", "0W1"]


def test_a_table_whose_order_crosses_messages_is_refused_with_the_grid(tmp_path: Path) -> None:
    path = table(tmp_path, "0F0,0F1,0B1,0B0\n1F0,1F1,1B0,1B1\n")
    with pytest.raises(ScheduleError) as caught:
        load_csv(path)
    message = str(caught.value)
    assert "the table's order cannot run" in message and "crossed send/recv order from rank 1 to rank 0" in message
    assert GRID.search(message) and "*0RECV_B1<-1*" in message


def test_a_deadlocked_table_is_refused_by_the_recipe_naming_the_ranks(tmp_path: Path) -> None:
    path = table(tmp_path, "0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n")  # rank 0 waits for B0 while rank 1 waits for F1
    model, batch = gpt_and_batch()
    with pytest.raises(ScheduleError, match=r"cross-rank cycle: rank 0 -> rank 1 -> rank 0") as caught:
        lnn.parallelize(model, batch, "1f1b", 2, step="training_step", schedule_csv=path)
    assert f"schedule_csv {path!r}" in str(caught.value) and GRID.search(str(caught.value))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0F0,0X0\n1F0,1B0\n", r"row 1 \(rank 0\), cell 2 '0X0': unknown action: expected <stage><F\|B\|I\|W"),
        ("0F0,0UNSHARD,0B0\n1F0,1B0\n", r"row 1 \(rank 0\), cell 2 '0UNSHARD': unknown action: torch's FSDP"),
        ("0F0,0F1,0B0\n1F0,1B0,1F1,1B1\n", r"stage 0 microbatch 1 has no backward \(B or I\); add 0B1 to row 1 \(rank 0\) after cell 2 '0F1'"),
        ("0B0,0F0\n1F0,1B0\n", r"row 1 \(rank 0\), cell 1 '0B0': backward \(B or I\) of stage 0 microbatch 0 before its forward"),
        ("0F0,0B0,1F0\n1F0,1B0\n", r"row 2 \(rank 1\), cell 1 '1F0': stage 1 is already on rank 0 \(row 1 \(rank 0\), cell 3"),
        ("0F0,0F0,0B0\n1F0,1B0\n", r"row 1 \(rank 0\), cell 2 '0F0': repeats row 1 \(rank 0\), cell 1"),
        ("0F0,0I0\n1F0,1I0,1W0\n", r"stage 0 microbatch 0 has no weight gradient \(W\); add 0W0 to row 1 \(rank 0\)"),
        ("0F0,0B0\n\n1F0,1B0\n", r"row 2 \(rank 1\) runs no stage"),
    ],
)
def test_a_malformed_table_is_refused_naming_the_row_and_cell(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_csv(table(tmp_path, text))


def test_a_table_for_another_number_of_ranks_or_microbatches_is_refused_by_the_recipe(tmp_path: Path) -> None:
    model, batch = gpt_and_batch()
    path = table(tmp_path, format_csv(one_f_one_b(2, 4)))
    with pytest.raises(ValueError, match=r"schedule_csv '.*': the table has 2 rows, one per rank, but the pipeline has 4 ranks"):
        lnn.parallelize(model, batch, "1f1b", 4, step="training_step", schedule_csv=path)
    with pytest.raises(ValueError, match=r"the table runs microbatches 0 … 3, but microbatches=8 was asked for"):
        lnn.parallelize(model, batch, "1f1b", 2, step="training_step", schedule_csv=path, microbatches=8)
    with pytest.raises(ValueError, match=r"schedule_csv: cannot read '.*missing.csv'"):
        lnn.parallelize(model, batch, "1f1b", 2, step="training_step", schedule_csv=str(tmp_path / "missing.csv"))


def torch_dualpipev_table(tmp_path: Path, ranks: int, microbatches: int) -> str:
    """torch's ScheduleDualPipeV order written as its ``_dump_csv`` writes ``pipeline_order`` (one row of
    ``_Action`` texts per rank, overlapped pairs as ``(0F2;3B0)OVERLAP_F_B``)."""
    owner = SimpleNamespace(pp_group_size=ranks, _n_microbatches=microbatches)
    path = tmp_path / f"dualpipev_{ranks}x{microbatches}.csv"
    with open(path, "w", newline="") as file:
        for rank in range(ranks):
            csv.writer(file).writerow(torch_schedules.ScheduleDualPipeV._calculate_single_rank_operations(owner, rank))
    return str(path)


def test_torch_s_own_dualpipev_table_runs_as_schedule_csv(tmp_path: Path) -> None:
    """torch's table (I, W, fused B and OVERLAP_F_B cells) imports as ``dual_pipe_v`` and a GPT planned with it verifies."""
    path = torch_dualpipev_table(tmp_path, 2, 4)
    text = Path(path).read_text()
    assert "(0F3;3B1)OVERLAP_F_B" in text and "3I0,3W0" in text and ",3B2," in text  # overlapped pair, split and fused backward
    assert load_csv(path) == dual_pipe_v(2, 4)
    model, batch = gpt_and_batch()
    plan = lnn.parallelize(model, batch, "zb1", 2, step="training_step", schedule_csv=path)
    assert plan.verify().parameters_checked == len(list(model.parameters()))
    assert plan.pipeline.schedule == dual_pipe_v(2, 4)


def test_a_table_whose_messages_cross_is_refused_by_the_recipe_with_the_grid(tmp_path: Path) -> None:
    """torch's DualPipeV at 3 ranks: rank 0 sends 0F4 before 5B0's gradient, rank 1 takes 4's gradient first."""
    path = torch_dualpipev_table(tmp_path, 3, 6)
    model, batch = gpt_and_batch()
    with pytest.raises(ScheduleError) as caught:
        lnn.parallelize(model, batch, "zb1", 3, step="training_step", schedule_csv=path)
    message = str(caught.value)
    assert f"schedule_csv {path!r}: the table's order cannot run: crossed send/recv order from rank 0 to rank 1" in message
    assert "message 4 is 0SEND_F4->1 on rank 0, but rank 1 receives it as 4RECV_B0<-0" in message
    assert re.search(r"^step \| rank 0 +\| rank 1 +\| rank 2", message, re.M) and "*0SEND_F4->1*" in message and "*4RECV_B0<-0*" in message
