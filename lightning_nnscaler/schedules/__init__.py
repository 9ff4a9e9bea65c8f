"""Pipeline schedules as plain data (DESIGN.md §8): generators, lowering, validation, rendering, metrics.

A generator gives compute-only per-rank lists (``one_f_one_b(4, 8).as_text()``); ``lower`` inserts the
SEND/RECV actions; ``zbv``, ``v_half`` and ``dual_pipe_v`` give V-shaped placements (two stages per rank); ``load_csv`` imports a per-rank table in torch's CSV format; ``validate`` runs all lists symbolically and raises ``ScheduleError`` with the
step × rank grid when the schedule would hang or mispair messages. Nothing here imports torch.
"""

from lightning_nnscaler.schedules.actions import SHARED, Action, Kind, Schedule, Timeline
from lightning_nnscaler.schedules.csv_import import format_csv, load_csv, parse_table
from lightning_nnscaler.schedules.dual_pipe import dual_pipe_v
from lightning_nnscaler.schedules.gpipe import gpipe
from lightning_nnscaler.schedules.interlaced import interlaced
from lightning_nnscaler.schedules.interleaved import interleaved
from lightning_nnscaler.schedules.lower import lower
from lightning_nnscaler.schedules.metrics import Durations, bubble_fraction, peak_in_flight, theoretical_bubble_fraction
from lightning_nnscaler.schedules.one_f_one_b import one_f_one_b
from lightning_nnscaler.schedules.recycling import interleaved_recycling, three_f_one_b
from lightning_nnscaler.schedules.render import grid
from lightning_nnscaler.schedules.v_shape import v_half, zbv
from lightning_nnscaler.schedules.validate import ScheduleError, execute, validate
from lightning_nnscaler.schedules.zero_bubble import zb1

__all__ = [
    "SHARED",
    "Action",
    "Durations",
    "Kind",
    "Schedule",
    "ScheduleError",
    "Timeline",
    "bubble_fraction",
    "dual_pipe_v",
    "execute",
    "format_csv",
    "gpipe",
    "grid",
    "interlaced",
    "interleaved",
    "interleaved_recycling",
    "load_csv",
    "lower",
    "one_f_one_b",
    "parse_table",
    "peak_in_flight",
    "theoretical_bubble_fraction",
    "three_f_one_b",
    "v_half",
    "validate",
    "zb1",
    "zbv",
]
