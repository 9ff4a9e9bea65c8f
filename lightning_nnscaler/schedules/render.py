"""The step × rank grid of a schedule, as text (for errors and ``plan.explain()``).

Rows are steps (the distinct start times of a timeline, or list positions when there is none),
columns are ranks, each cell is the text of the action(s) the rank starts at that step, and marked
cells read ``*1B0*``. Actions that never ran (a deadlock) follow the rank's last executed step in
list order, so the grid always shows every action.
"""

from __future__ import annotations

from collections.abc import Collection

from lightning_nnscaler.schedules.actions import Schedule, Timeline


def grid(schedule: Schedule, timeline: Timeline | None = None, mark: Collection[tuple[int, int]] = ()) -> str:
    """Render ``schedule`` as a step × rank grid.

    Args:
        schedule: the per-rank action lists.
        timeline: start times from ``validate.execute``; without one, step i is each rank's i-th action.
        mark: ``(rank, index)`` positions whose cells are wrapped in ``*…*`` (e.g. the stuck actions).
    """
    steps = _steps(schedule, timeline)
    rows = sorted({step for rank_steps in steps for step in rank_steps})
    row_of = {step: row for row, step in enumerate(rows)}
    cells = [["" for _ in range(schedule.world_size)] for _ in rows]
    for rank, rank_actions in enumerate(schedule.actions):
        for index, action in enumerate(rank_actions):
            text = f"*{action}*" if (rank, index) in mark else str(action)
            cell = cells[row_of[steps[rank][index]]]
            cell[rank] = f"{cell[rank]} {text}".strip()
    header = ["step", *(f"rank {rank}" for rank in range(schedule.world_size))]
    labels = [_label(step) for step in rows]
    widths = [max(len(text) for text in [header[0], *labels])]
    widths += [max([len(header[rank + 1]), *(len(row[rank]) for row in cells)]) for rank in range(schedule.world_size)]
    lines = [_line(header, widths), _line(["-" * width for width in widths], widths)]
    lines += [_line([label, *row], widths) for label, row in zip(labels, cells)]
    return "\n".join(lines)


def _steps(schedule: Schedule, timeline: Timeline | None) -> list[list[float]]:
    """The row key of every action: its start time, or for actions that never ran, the next free steps."""
    if timeline is None:
        return [list(map(float, range(len(rank_actions)))) for rank_actions in schedule.actions]
    steps = []
    for rank, rank_actions in enumerate(schedule.actions):
        rank_steps: list[float] = []
        next_free = 0.0
        for index in range(len(rank_actions)):
            start, end = timeline.starts[rank][index], timeline.ends[rank][index]
            if start is None or end is None:
                start, end = next_free, next_free + 1
            rank_steps.append(start)
            next_free = max(next_free, end)
        steps.append(rank_steps)
    return steps


def _label(step: float) -> str:
    return str(int(step)) if float(step).is_integer() else f"{step:g}"


def _line(texts: list[str], widths: list[int]) -> str:
    return " | ".join(text.ljust(width) for text, width in zip(texts, widths)).rstrip()
