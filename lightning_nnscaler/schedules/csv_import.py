"""Import a per-rank action table in torch.distributed.pipelining's CSV format (issue 38: schedules from papers).

One row per rank, one cell per step, as ``PipelineScheduleMulti._load_csv`` reads (torchtitan's
``pipeline_parallel_schedule_csv``): ``0F0,0F1,0B0,...``; an empty cell is an idle step. Cells use
torch's ``_Action`` text: ``F`` forward, ``B`` full backward, ``I`` input-gradient half, ``W``
weight-gradient half, and the communication actions of torch's ``compute_comms`` form (``1RECV_F0``,
``0SEND_F0``, ``SEND_B``/``RECV_B``; the peer is inferred, or written as ``0SEND_F0->1`` / ``1RECV_F0<-0``).

Mapping to this project's kinds: with no ``I`` or ``W`` in the table, ``B`` is ``B``. With them (a
split backward), ``I`` is ``B`` (input gradients only) and a fused ``B`` becomes ``B`` then ``W``. torch's
overlapped pair ``(0F2;3B0)OVERLAP_F_B`` (``ScheduleDualPipeV``) is its actions in order, here one after
the other. Where a stage lives is read from the table (each stage on exactly one row), so V-shaped and
interleaved placements import as they are. torch's FSDP and reduction actions (``UNSHARD``, ``RESHARD``,
``REDUCE_GRAD``) are refused.

Checks, each naming the row (rank) and cell: the text parses, every stage is on one rank, a
microbatch's B follows its F and its W follows its B on that rank, each (stage, microbatch) has its
F and B (and W when split) exactly once. Then the order runs through ``validate`` (the table as given
when it holds communication, else ``lower`` of it), whose ``ScheduleError`` carries the step × rank grid.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Sequence
from pathlib import Path

from lightning_nnscaler.schedules.actions import B, F, W, Action, Kind, Schedule
from lightning_nnscaler.schedules.lower import lower
from lightning_nnscaler.schedules.validate import ScheduleError, validate

_CELL = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|I|B|W)(\d+)(?:(->|<-)(\d+))?")
_UNSUPPORTED = re.compile(r"\d+(UNSHARD|RESHARD|REDUCE_GRAD)\d*")
_OVERLAPPED = re.compile(r"\((.*)\)OVERLAP_F_B")
_COMPUTE = ("F", "I", "B", "W")
Cell = tuple[int, int, str]  # (row, column, text), 0-based; messages print them 1-based


def read_csv(path: str | Path) -> list[list[str]]:
    """The table's rows of cell texts (as ``csv.reader`` reads them; no header)."""
    with open(path, newline="") as file:
        return [list(row) for row in csv.reader(file)]


def format_csv(schedule: Schedule) -> str:
    """A compute-only schedule as CSV text (one line per rank); ``parse_table`` reads it back."""
    split = schedule.splits_backward
    return "".join(",".join(_torch_text(action, split) for action in rank_actions) + "\n" for rank_actions in schedule.actions)


def load_csv(path: str | Path, *, ranks: int | None = None, microbatches: int | None = None) -> Schedule:
    """Read, check and validate the table at ``path``; returns the compute-only ``Schedule`` (see ``parse_table``)."""
    return parse_table(read_csv(path), source=str(path), ranks=ranks, microbatches=microbatches)


def parse_table(rows: Sequence[Sequence[str]], *, source: str = "schedule table", ranks: int | None = None,
                microbatches: int | None = None) -> Schedule:
    """The compute-only schedule of a per-rank action table, checked and validated.

    Args:
        rows: ``rows[rank]`` is that rank's cells, in order; empty cells are idle steps.
        source: how messages name the table (its path).
        ranks: the pipeline's ranks, when the caller knows them: the table must have that many rows.
        microbatches: when given, the table must use exactly microbatches 0 … microbatches - 1.

    Raises:
        ValueError: naming ``source``, the row (rank) and the cell of an unknown action, a stage on two
            ranks, a backward before its forward, or a missing/repeated action; or a wrong row count.
        ScheduleError: when the order deadlocks or crosses messages, with the validator's grid.
    """
    rows = [list(row) for row in rows]
    while rows and not any(text.strip() for text in rows[-1]):  # a file's trailing blank lines are no ranks
        rows.pop()
    if ranks is not None and len(rows) != ranks:
        raise ValueError(f"{source}: the table has {len(rows)} rows, one per rank, but the pipeline has {ranks} ranks")
    if not rows:
        raise ValueError(f"{source}: the table is empty; write one row of actions per rank, e.g. '0F0,0B0'")
    cells = [[_parse_cell(source, row, column, part) for column, text in enumerate(texts) if text.strip() for part in _parts(text)]
             for row, texts in enumerate(rows)]
    split = any(kind in ("I", "W") for rank_cells in cells for _, kind, _, _, _ in rank_cells)
    stage_ranks = _stage_ranks(source, cells)
    count = 1 + max((microbatch for rank_cells in cells for _, kind, _, microbatch, _ in rank_cells if kind in _COMPUTE), default=-1)
    if microbatches is not None and count != microbatches:
        raise ValueError(f"{source}: the table runs microbatches 0 … {count - 1}, but microbatches={microbatches} was asked for")
    actions = [[action for parsed in rank_cells for action in _actions(source, parsed, split, stage_ranks)] for rank_cells in cells]
    _check_order(source, cells, split, len(stage_ranks), count)
    compute = Schedule([[action for action in rank if action.kind.is_compute] for rank in actions], stage_ranks, count)
    with_comms = any(not action.kind.is_compute for rank in actions for action in rank)
    lowered = Schedule(actions, stage_ranks, count) if with_comms else lower(compute)
    try:
        validate(lowered)
    except ScheduleError as error:
        raise ScheduleError(f"{source}: the table's order cannot run: {error}") from None
    return compute


def _parts(text: str) -> list[str]:
    """The action texts of one cell: those of an overlapped pair ``(…;…)OVERLAP_F_B`` in order, else the cell."""
    overlapped = _OVERLAPPED.fullmatch(text.strip())
    return [part for part in overlapped.group(1).split(";") if part.strip()] if overlapped else [text]


def _parse_cell(source: str, row: int, column: int, text: str) -> tuple[Cell, str, int, int, int | None]:
    """(cell, kind text, stage, microbatch, peer) of one non-empty cell."""
    cell = (row, column, text.strip())
    match = _CELL.fullmatch(cell[2])
    if match is None:
        why = ("torch's FSDP / gradient-reduction actions are not supported" if _UNSUPPORTED.fullmatch(cell[2])
               else "expected <stage><F|B|I|W|SEND_F|RECV_F|SEND_B|RECV_B><microbatch>, e.g. '1F0', '0I2', '0SEND_F0'")
        raise ValueError(f"{source}: {_where(cell)}: unknown action: {why}")
    stage, kind, microbatch, arrow, peer = match.groups()
    expected_arrow = "->" if kind.startswith("SEND") else "<-" if kind.startswith("RECV") else None
    if arrow is not None and arrow != expected_arrow:
        raise ValueError(f"{source}: {_where(cell)}: {kind} takes {expected_arrow or 'no peer'}, got {arrow}")
    return cell, kind, int(stage), int(microbatch), None if peer is None else int(peer)


def _where(cell: Cell) -> str:
    row, column, text = cell
    return f"row {row + 1} (rank {row}), cell {column + 1} {text!r}"


def _stage_ranks(source: str, cells: list[list[tuple]]) -> tuple[int, ...]:
    """Where each stage lives, read from the compute cells: each stage on exactly one row, none skipped."""
    holder: dict[int, tuple[int, Cell]] = {}
    for rank, rank_cells in enumerate(cells):
        for cell, kind, stage, _, _ in rank_cells:
            if kind in _COMPUTE and holder.setdefault(stage, (rank, cell))[0] != rank:
                first = holder[stage][1]
                raise ValueError(f"{source}: {_where(cell)}: stage {stage} is already on rank {first[0]} ({_where(first)}); "
                                 "each stage runs on the one rank that holds it")
    absent = [stage for stage in range(max(holder, default=-1) + 1) if stage not in holder]
    if absent or not holder:
        raise ValueError(f"{source}: stages {absent or [0]} have no actions; number the stages 0, 1, … without gaps")
    idle = sorted(set(range(len(cells))) - {rank for rank, _ in holder.values()})
    if idle:
        raise ValueError(f"{source}: row {idle[0] + 1} (rank {idle[0]}) runs no stage; every rank needs at least one")
    return tuple(holder[stage][0] for stage in range(len(holder)))


def _actions(source: str, parsed: tuple, split: bool, stage_ranks: tuple[int, ...]) -> list[Action]:
    """This project's actions of one cell: a fused B in a split table is B then W; I is B; a peer is inferred."""
    cell, kind, stage, microbatch, peer = parsed
    if kind in _COMPUTE:
        return [Action(stage, microbatch, ours) for ours in {"F": [F], "I": [B], "W": [W], "B": [B, W] if split else [B]}[kind]]
    neighbour = stage + 1 if kind in ("SEND_F", "RECV_B") else stage - 1
    if peer is None and not 0 <= neighbour < len(stage_ranks):
        raise ValueError(f"{source}: {_where(cell)}: stage {stage} has no stage {neighbour} to exchange {kind} with")
    return [Action(stage, microbatch, Kind(kind), stage_ranks[neighbour] if peer is None else peer)]


def _check_order(source: str, cells: list[list[tuple]], split: bool, stages: int, microbatches: int) -> None:
    """Per rank: B after its F, W after its B, each once; every (stage, microbatch) complete."""
    seen: dict[tuple[int, int, str], Cell] = {}
    for rank_cells in cells:
        for cell, kind, stage, microbatch, _ in rank_cells:
            if kind not in _COMPUTE:
                continue
            kinds = ["B", "W"] if kind == "B" and split else ["B" if kind == "I" else kind]
            for one in kinds:
                if (stage, microbatch, one) in seen:
                    raise ValueError(f"{source}: {_where(cell)}: repeats {_where(seen[stage, microbatch, one])}; "
                                     f"each (stage, microbatch) runs {one} once")
                before = {"F": None, "B": "F", "W": "B"}[one]
                if before is not None and (stage, microbatch, before) not in seen:
                    raise ValueError(f"{source}: {_where(cell)}: {_name(one)} of stage {stage} microbatch {microbatch} "
                                     f"before its {_name(before)}; move it after the {_name(before)}")
                seen[stage, microbatch, one] = cell
    kinds = ("F", "B", "W") if split else ("F", "B")
    for stage in range(stages):
        for microbatch in range(microbatches):
            missing = [kind for kind in kinds if (stage, microbatch, kind) not in seen]
            if missing:
                have = next((seen[stage, microbatch, kind] for kind in kinds if (stage, microbatch, kind) in seen), None)
                where = f"row {have[0] + 1} (rank {have[0]}) after cell {have[1] + 1} {have[2]!r}" if have else f"stage {stage}'s row"
                raise ValueError(f"{source}: stage {stage} microbatch {microbatch} has no {', '.join(_name(kind) for kind in missing)}; "
                                 f"add {', '.join(f'{stage}{kind}{microbatch}' for kind in missing)} to {where}")


def _name(kind: str) -> str:
    return {"F": "forward (F)", "B": "backward (B or I)", "W": "weight gradient (W)"}[kind]


def _torch_text(action: Action, split: bool) -> str:
    """torch's text of an action: this project's B is torch's I when the backward is split."""
    return f"{action.stage}I{action.microbatch}" if split and action.kind is B else str(action)
