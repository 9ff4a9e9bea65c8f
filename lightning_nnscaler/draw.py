"""Plan pictures: per-rank memory bars and a per-rank action timeline (``draw_plan``).

Durations come from a simple cost estimate until the simulator exists: a compute action takes its
op's FLOPs (2·M·N·K for matmul-like ops, one per output element otherwise; ×3 for forward and
backward) at ``PEAK_FLOPS``; a message arrives ``LATENCY_S`` plus its bytes at ``BANDWIDTH`` after
it is sent (sends are asynchronous: the sender only posts it), and a collective takes the same for
the bytes each member sends. Ranks are replayed together: a receive waits for its message, and a
collective starts when its last member reaches it, so waiting shows as idle time.

matplotlib is imported here only (Agg backend), so ``import lightning_nnscaler`` never imports it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_nnscaler.explain import MEMORY_KEYS
from lightning_nnscaler.ir.tensor import dtype_bytes
from lightning_nnscaler.materialize.program import Collective, Compute, Program, Recv, Send

Plan = Any  # lightning_nnscaler.parallelize.Plan, which imports this module (Plan.draw): duck-typed here

PEAK_FLOPS = 1e12
"""Assumed compute rate (FLOP/s) of one rank: a round figure for a few CPU cores or a small GPU slice."""
BANDWIDTH = 10e9
"""Assumed bytes per second of one link (order of a PCIe 4 x16 link)."""
LATENCY_S = 5e-6
"""Assumed start-up time of one message (alpha of the alpha-beta model)."""
MATMUL_TARGETS = ("linear", "mm", "matmul", "bmm", "addmm", "baddbmm", "einsum", "conv", "scaled_dot_product_attention")
"""Op targets costed as 2·(output elements)·(contracted size)."""
COLORS = {"compute": "#4c72b0", "backward": "#64b5cd", "communication": "#dd8452", "idle": "#d9d9d9"}
"""Span kinds; "backward" (B and W of a pipeline schedule) only in pipelined plans, whose forward is "compute"."""
MEMORY_KINDS = MEMORY_KEYS
MEMORY_COLORS = ("#4c72b0", "#55a868", "#c44e52", "#8172b2", "#ccb974")


@dataclass(frozen=True)
class Span:
    """One bar of the timeline: ``kind`` (compute, communication or idle) from ``start`` to ``end`` seconds."""

    kind: str
    start: float
    end: float
    label: str


def compute_seconds(action: Compute) -> float:
    """Estimated forward + backward time of one compute action (see the module docstring)."""
    outputs = sum(math.prod(output.shape) for output in action.op.outputs)
    flops = float(outputs)
    if any(name in action.op.target for name in MATMUL_TARGETS):
        inputs = action.op.tensor_inputs
        contracted = inputs[0].shape[-1] if inputs and inputs[0].shape else 1
        flops = 2.0 * outputs * contracted
    return 3.0 * flops / PEAK_FLOPS


def _message_bytes(program: Program) -> dict[tuple[int, int, int], int]:
    """Bytes of every point-to-point message by (source, destination, tag), read from the receives."""
    sizes = {}
    for rank_program in program.ranks:
        for action in rank_program.actions:
            if isinstance(action, Recv):
                sizes[(action.src, rank_program.rank, action.tag)] = math.prod(action.shape) * dtype_bytes(action.dtype)
    return sizes


def timeline(program: Program) -> list[list[Span]]:
    """Every rank's spans, replaying all ranks' actions in order with the cost estimate.

    A receive waits for its send; a collective starts when its last member arrives; the wait is an
    idle span. Actions of other kinds (assembling pieces) are free.
    """
    messages = _message_bytes(program)
    clocks = [0.0] * program.world_size
    cursors = [0] * program.world_size
    spans: list[list[Span]] = [[] for _ in range(program.world_size)]
    sent: dict[tuple[int, int, int], float] = {}
    arrived: dict[tuple[Any, ...], dict[int, float]] = {}  # collective key -> rank -> arrival time
    progress = True
    while progress:
        progress = False
        for rank, rank_program in enumerate(program.ranks):
            while cursors[rank] < len(rank_program.actions):
                action = rank_program.actions[cursors[rank]]
                if not _step(rank, action, clocks, spans, messages, sent, arrived):
                    break  # blocked until a peer gets further
                cursors[rank] += 1
                progress = True
    return spans


def _step(rank: int, action: Any, clocks: list[float], spans: list[list[Span]], messages: dict, sent: dict, arrived: dict) -> bool:
    """Advance ``rank`` over ``action``; False when it must wait for a peer that has not got there yet."""
    now = clocks[rank]
    if isinstance(action, Compute):
        end = now + compute_seconds(action)
        spans[rank].append(Span("compute", now, end, action.op.target))
    elif isinstance(action, Send):  # asynchronous: the sender posts it; the data arrives after the transfer
        key = (rank, action.dst, action.tag)
        sent[key] = now + LATENCY_S + messages.get(key, 0) / BANDWIDTH
        spans[rank].append(Span("communication", now, now + LATENCY_S, f"send to {action.dst}"))
    elif isinstance(action, Recv):
        key = (action.src, rank, action.tag)
        if key not in sent:
            return False
        ready = max(now, sent[key])
        if ready > now:
            spans[rank].append(Span("idle", now, ready, f"wait for {action.src}"))
        end = ready + LATENCY_S
        spans[rank].append(Span("communication", ready, end, f"recv from {action.src}"))
    elif isinstance(action, Collective):
        key = (action.kind, action.ranks, action.position)
        members = arrived.setdefault(key, {})
        members.setdefault(rank, now)
        if len(members) < len(action.ranks):
            return False
        start = max(members.values())
        # ring collectives move about 2·(n-1)/n of the buffer per rank; bytes_per_device is what this rank sends
        end = start + LATENCY_S * len(action.ranks) + action.bytes_per_device / BANDWIDTH
        if start > now:
            spans[rank].append(Span("idle", now, start, "wait for the group"))
        spans[rank].append(Span("communication", start, end, action.kind))
    else:
        return True
    clocks[rank] = spans[rank][-1].end if spans[rank] else now
    return True


def pipeline_timeline(plan: Plan) -> list[list[Span]]:
    """Every rank's spans of a pipelined plan: its schedule (lowered with sends and receives) run
    symbolically, a stage's forward of one microbatch costed as its compute actions' forward FLOPs (the
    busiest rank holding the stage), B twice that (B and W once each when the schedule splits backward),
    a send or receive ``LATENCY_S``."""
    from lightning_nnscaler.schedules import Kind, execute, lower

    pipeline = plan.pipeline
    assert pipeline is not None
    per_rank: dict[tuple[int, int], float] = {}  # (rank, stage) -> forward seconds of all its microbatches
    for rank_program in plan.program.ranks:
        for action in rank_program.actions:
            if isinstance(action, Compute) and action.segment is not None:
                key = (rank_program.rank, action.segment[0])
                per_rank[key] = per_rank.get(key, 0.0) + compute_seconds(action) / 3
    forward: dict[int, float] = {}
    for (_, stage), seconds in per_rank.items():
        forward[stage] = max(forward.get(stage, 0.0), seconds / pipeline.schedule.microbatches)
    schedule = lower(pipeline.schedule)
    splits = any(action.kind is Kind.WEIGHT for column in schedule.actions for action in column)

    def duration(action: Any) -> float:
        if not action.kind.is_compute:
            return LATENCY_S
        seconds = forward.get(action.stage, 0.0)
        return 2 * seconds if action.kind is Kind.BACKWARD and not splits else seconds

    timeline = execute(schedule, duration)
    spans: list[list[Span]] = []
    for rank in range(plan.world_size):
        column = pipeline.column_of_rank[rank]
        rank_spans: list[Span] = []
        clock = 0.0
        for action, start, end in zip(schedule.actions[column], timeline.starts[column], timeline.ends[column], strict=True):
            if start is None or end is None:
                continue
            if start > clock:
                rank_spans.append(Span("idle", clock, start, "wait"))
            kind = "communication" if not action.kind.is_compute else "compute" if action.kind is Kind.FORWARD else "backward"
            rank_spans.append(Span(kind, start, end, str(action)))
            clock = max(clock, end)
        spans.append(rank_spans)
    return spans


def memory_rows(plan: Plan) -> list[dict[str, int]]:
    """``Plan.memory_rows()``: every rank's row of ``explain.ROW_KEYS`` (bytes held, and sent per step)."""
    return plan.memory_rows()


def draw_plan(plan: Plan, path: str | os.PathLike[str]) -> Path:
    """Write ``path`` (PNG): per-rank memory bars (``explain.MEMORY_KEYS``: the columns of ``Plan.explain``) on the
    left, the per-rank action timeline (compute / communication / idle) on the right. Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = memory_rows(plan)
    spans = pipeline_timeline(plan) if getattr(plan, "pipeline", None) is not None else timeline(plan.program)
    ranks = list(range(plan.world_size))
    height = max(3.5, 0.45 * plan.world_size + 2.4)
    figure, (memory_axes, time_axes) = plt.subplots(1, 2, figsize=(14, height), gridspec_kw={"width_ratios": [1, 2.4]})
    _draw_memory(memory_axes, rows, ranks)
    _draw_timeline(time_axes, spans, ranks)
    handles = [Patch(color=color, label=kind) for kind, color in zip(MEMORY_KINDS, MEMORY_COLORS, strict=True)]
    present = {span.kind for rank_spans in spans for span in rank_spans} | {"compute", "communication", "idle"}
    handles += [Patch(color=color, label=kind) for kind, color in COLORS.items() if kind in present]
    figure.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    params = f" {plan.params}" if plan.params else ""
    figure.suptitle(f"plan {plan.plan_hash[:12]}: recipe {plan.recipe}{params} on {plan.world_size} ranks", fontsize=11)
    figure.tight_layout(rect=(0, 0.6 / height, 1, 1))
    output = Path(path)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=110)
    plt.close(figure)
    return output


def _draw_memory(axes: Any, rows: Sequence[dict[str, int]], ranks: list[int]) -> None:
    left = [0.0] * len(ranks)
    for kind, color in zip(MEMORY_KINDS, MEMORY_COLORS, strict=True):
        values = [row[kind] / 2**20 for row in rows]
        axes.barh(ranks, values, left=left, color=color)
        left = [a + b for a, b in zip(left, values, strict=True)]
    axes.set_yticks(ranks, [f"rank {rank}" for rank in ranks])
    axes.invert_yaxis()
    axes.set_xlabel("estimated memory (MiB)")
    axes.set_title("memory per rank", fontsize=10)


def _draw_timeline(axes: Any, spans: list[list[Span]], ranks: list[int]) -> None:
    for rank in ranks:
        for kind in COLORS:
            bars = [(span.start * 1e3, (span.end - span.start) * 1e3) for span in spans[rank] if span.kind == kind]
            if bars:
                axes.broken_barh(bars, (rank - 0.4, 0.8), facecolors=COLORS[kind])
    axes.set_yticks(ranks, [f"rank {rank}" for rank in ranks])
    axes.invert_yaxis()
    axes.set_xlabel("estimated time of one step (ms, forward + backward)")
    axes.set_title("actions per rank (cost estimate)", fontsize=10)
