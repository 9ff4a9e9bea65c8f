"""Plan pictures (``draw_plan``): per-rank predicted memory bars and the simulated timeline of one step.

Both come from ``sim.predict(plan, spec, record=True)``: the bars are its memory rows (``explain``'s
columns, activations at their simulated peak); the timeline is its recorded spans, one bar each, on the
spec's hardware — forward, backward, a pipeline's W (labelled with its action, ``1F0``), the optimizer
step, communication (the transfer of a receive or collective) and idle (waiting for a peer, or done
before the slowest rank). Each action's label is written in its widest bar, across or along it, where it
fits. The title (wrapped to the figure's width) gives the recipe, the predicted step time and the spec.

matplotlib and the simulator are imported here only (Agg backend), so ``import lightning_nnscaler``
never imports them.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_nnscaler.explain import MEMORY_KEYS

Plan = Any  # lightning_nnscaler.plan.Plan, which imports this module (Plan.draw): duck-typed here
Prediction = Any  # lightning_nnscaler.sim.Prediction: the simulator is imported when drawing

COLORS = {
    "forward": "#2a6f97", "backward": "#7fb8da", "weight": "#b8a9e3", "optimizer": "#f2a541", "other": "#937860",
    "communication": "#d1495b", "idle": "#e0e0e0",
}
"""Colour of each span kind the simulator records (a compute task's kind, communication, idle)."""
MEMORY_COLORS = ("#4c72b0", "#55a868", "#c44e52", "#8172b2", "#ccb974")
LABELLED_KINDS = ("forward", "backward", "weight")
"""Kinds whose bars show their label (a pipeline's action) when the bar is wide enough to hold it."""
LABEL_COLORS = {"forward": "white"}
"""Label colour on a dark bar (black on the others)."""
LABEL_PLACINGS = ((7, 0), (7, 90), (6, 90))
"""``(font size, rotation)`` a label tries in turn: across its bar, along it, then along it smaller."""
LABEL_PADDING_PX = 1.5  # a label keeps this far from its bar's edges
BAR_HEIGHT = 0.8  # of a rank's row
TITLE_SHARE = 0.96  # of the figure's width the title may take, so tight_layout has no reason to cut it
DPI = 110


@dataclass(frozen=True)
class Bar:
    """One bar of the timeline: a simulated span's ``kind`` and ``label``, ``start`` and ``width`` in ms."""

    kind: str
    start_ms: float
    width_ms: float
    label: str


def timeline_bars(prediction: Prediction) -> list[list[Bar]]:
    """Per rank, the bars the picture draws: one per span of ``prediction.simulation.spans`` (recorded
    with ``predict(..., record=True)``), in the same order."""
    return [
        [Bar(span.kind, span.start * 1e3, (span.end - span.start) * 1e3, span.label) for span in rank_spans]
        for rank_spans in prediction.simulation.spans
    ]


def draw_plan(plan: Plan, path: str | os.PathLike[str], spec: Any = "a100", *, prediction: Prediction | None = None) -> Path:
    """Write ``path`` (PNG, ``plan_figure``): per-rank predicted memory bars on the left, the simulated
    timeline of one step on ``spec`` (a shipped spec's name, a YAML path or a ``HardwareSpec``) on the right.

    ``prediction``: one already recorded for this plan (``predict(plan, spec, record=True)``); it is
    made here otherwise. Returns the path.
    """
    import matplotlib.pyplot as plt

    figure = plan_figure(plan, spec, prediction=prediction)
    output = Path(path)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=DPI)
    plt.close(figure)
    return output


def plan_figure(plan: Plan, spec: Any = "a100", *, prediction: Prediction | None = None) -> Any:
    """The plan picture as a matplotlib ``Figure`` (laid out: the title wrapped to the figure's width, every
    action bar labelled where its label fits); ``draw_plan`` saves it. The caller closes it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if prediction is None or not prediction.simulation.spans:
        from lightning_nnscaler.sim import predict

        prediction = predict(plan, spec, record=True)
    bars = timeline_bars(prediction)
    ranks = list(range(plan.world_size))
    height = max(3.5, 0.45 * plan.world_size + 2.4)
    figure, (memory_axes, time_axes) = plt.subplots(1, 2, figsize=(14, height), dpi=DPI, gridspec_kw={"width_ratios": [1, 2.4]})
    _draw_memory(memory_axes, prediction.memory, ranks)
    _draw_timeline(time_axes, bars, ranks, prediction.step_seconds * 1e3)
    time_axes.set_title(f"simulated timeline on {prediction.spec_name}", fontsize=10)
    present = {bar.kind for rank_bars in bars for bar in rank_bars}
    for axes, legend in ((memory_axes, zip(MEMORY_KEYS, MEMORY_COLORS, strict=True)), (time_axes, COLORS.items())):
        handles = [Patch(color=color, label=kind) for kind, color in legend if axes is memory_axes or kind in present]
        axes.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3 if axes is memory_axes else len(handles), fontsize=8, frameon=False)
    renderer = figure.canvas.get_renderer()
    _wrap_to_width(figure.suptitle(plan_title(plan, prediction), fontsize=11), figure, renderer)
    figure.tight_layout()  # fixes the axes' places (suptitle included) before the labels are fitted into the bars
    _label_actions(time_axes, bars, ranks, renderer)
    return figure


def plan_title(plan: Plan, prediction: Prediction) -> str:
    """The picture's title: plan hash, recipe and its set parameters, ranks, and the predicted step on the spec."""
    params = "".join(f" {key}={value}" for key, value in plan.params.items() if value is not None)
    return (f"plan {plan.plan_hash[:12]}: recipe {plan.recipe}{params} on {plan.world_size} ranks; "
            f"predicted step {prediction.step_seconds * 1e3:.3f} ms on {prediction.spec_name}")


def _wrap_to_width(title: Any, figure: Any, renderer: Any) -> None:
    """Break ``title``'s text into lines at spaces until it is narrower than the figure (``TITLE_SHARE`` of it)."""
    text = title.get_text()
    for width in range(len(text), 19, -4):
        title.set_text(textwrap.fill(text, width))
        if title.get_window_extent(renderer).width <= TITLE_SHARE * figure.bbox.width:
            return


def memory_rows(plan: Plan) -> list[dict[str, int]]:
    """``Plan.memory_rows()``: every rank's row of ``explain.ROW_KEYS`` (bytes held, and sent per step)."""
    return plan.memory_rows()


def _draw_memory(axes: Any, rows: Sequence[dict[str, int]], ranks: list[int]) -> None:
    left = [0.0] * len(ranks)
    for kind, color in zip(MEMORY_KEYS, MEMORY_COLORS, strict=True):
        values = [row[kind] / 2**20 for row in rows]
        axes.barh(ranks, values, left=left, color=color)
        left = [a + b for a, b in zip(left, values, strict=True)]
    axes.set_yticks(ranks, [f"rank {rank}" for rank in ranks])
    axes.invert_yaxis()
    axes.set_xlabel("predicted memory (MiB)")
    axes.set_title("memory per rank", fontsize=10)


def _draw_timeline(axes: Any, bars: list[list[Bar]], ranks: list[int], step_ms: float) -> None:
    for rank in ranks:
        for kind in dict.fromkeys(bar.kind for bar in bars[rank]):
            extents = [(bar.start_ms, bar.width_ms) for bar in bars[rank] if bar.kind == kind]
            axes.broken_barh(extents, (rank - BAR_HEIGHT / 2, BAR_HEIGHT), facecolors=COLORS.get(kind, COLORS["other"]))
    axes.set_yticks(ranks, [f"rank {rank}" for rank in ranks])
    axes.invert_yaxis()
    axes.set_xlim(0, step_ms or 1.0)
    axes.set_xlabel("simulated time of one training step (ms)")


def action_bars(rank_bars: Sequence[Bar]) -> list[Bar]:
    """One bar per labelled action of a rank (``LABELLED_KINDS``): the widest of its spans (an action's
    compute may be cut by the messages it waits for)."""
    widest: dict[str, Bar] = {}
    for bar in rank_bars:
        if bar.kind not in LABELLED_KINDS or not bar.label:
            continue
        if bar.label not in widest or bar.width_ms > widest[bar.label].width_ms:
            widest[bar.label] = bar
    return list(widest.values())


def _label_actions(axes: Any, bars: list[list[Bar]], ranks: list[int], renderer: Any) -> None:
    """Write each action's label (``1F0``) in its widest bar, placed the first way of ``LABEL_PLACINGS`` that fits, or not at all."""
    for rank in ranks:
        for bar in action_bars(bars[rank]):
            (left, bottom), (right, top) = axes.transData.transform([(bar.start_ms, rank - BAR_HEIGHT / 2), (bar.start_ms + bar.width_ms, rank + BAR_HEIGHT / 2)])
            room = (abs(right - left) - LABEL_PADDING_PX, abs(top - bottom) - LABEL_PADDING_PX)
            text = axes.text(bar.start_ms + bar.width_ms / 2, rank, bar.label, ha="center", va="center", color=LABEL_COLORS.get(bar.kind, "black"))
            if not any(_fits(text, size, rotation, room, renderer) for size, rotation in LABEL_PLACINGS):
                text.remove()


def _fits(text: Any, size: float, rotation: float, room: tuple[float, float], renderer: Any) -> bool:
    """Whether ``text`` at font ``size`` and ``rotation`` (set so) fits ``room`` (width, height in pixels)."""
    text.set_fontsize(size)
    text.set_rotation(rotation)
    extent = text.get_window_extent(renderer)
    return extent.width <= room[0] and extent.height <= room[1]
