"""``plan.draw``: the picture's timeline is the simulator's recorded step, span for span, and its bars
add up to the predicted per-rank figures that ``explain(spec)`` and ``lightning-nnscaler plan`` print; its
title fits in the figure and its action bars are labelled."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.draw import LABELLED_KINDS, plan_figure, timeline_bars
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.sim import predict

COMPUTE_KINDS = ("forward", "backward", "weight", "optimizer", "other")


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, seq_len=8, hidden=16, layers=4, heads=2))


@pytest.mark.parametrize(("recipe", "params"), [("dp", {}), ("1f1b", {"microbatches": 4})])
def test_the_pictures_timeline_is_the_simulated_step(model: GPT, recipe: str, params: dict, tmp_path: Path) -> None:
    plan = lnn.parallelize(model, model.example_batch(8, torch.Generator().manual_seed(0)), recipe, 4, step="training_step", **params)
    picture = plan.draw(tmp_path / "plan.png", "a100")
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    prediction = predict(plan, "a100", record=True)
    bars = timeline_bars(prediction)
    spans = predict(plan, "a100", record=True).simulation.spans  # an independent run: the simulation is deterministic
    assert [[(bar.kind, bar.start_ms, bar.start_ms + bar.width_ms, bar.label) for bar in rank_bars] for rank_bars in bars] == [
        [(span.kind, pytest.approx(span.start * 1e3), pytest.approx(span.end * 1e3), span.label) for span in rank_spans] for rank_spans in spans
    ]
    step_ms = prediction.step_seconds * 1e3
    for rank_bars, row in zip(bars, prediction.rank_rows(), strict=True):
        # each rank's bars tile the step: compute, communication and idle add up to the printed figures
        assert rank_bars[0].start_ms == 0.0
        assert all(before.start_ms + before.width_ms == pytest.approx(after.start_ms) for before, after in zip(rank_bars, rank_bars[1:]))
        assert rank_bars[-1].start_ms + rank_bars[-1].width_ms == pytest.approx(step_ms)
        for kinds, key in ((COMPUTE_KINDS, "busy_ms"), (("communication",), "communication_ms"), (("idle",), "idle_ms")):
            assert sum(bar.width_ms for bar in rank_bars if bar.kind in kinds) == pytest.approx(row[key], abs=1e-9)
    if plan.pipeline is None:
        assert {"forward", "backward", "optimizer", "communication"} <= {bar.kind for bar in bars[0]}
        return
    for rank, rank_bars in enumerate(bars):  # a pipeline's compute bars are its schedule's F and B, in order
        labels = list(dict.fromkeys(bar.label for bar in rank_bars if bar.kind in LABELLED_KINDS and bar.label != "prologue"))
        assert labels == [str(action) for action in plan.pipeline.actions(rank) if action.kind.is_compute]
    assert any(bar.kind == "idle" for rank_bars in bars for bar in rank_bars)  # the bubble


def test_the_title_fits_in_the_picture_and_the_actions_are_labelled(model: GPT) -> None:
    plan = lnn.parallelize(model, model.example_batch(8, torch.Generator().manual_seed(0)), "1f1b", 4, step="training_step", microbatches=4)
    plan.params["spec"] = "/a/long/folder/of/hardware/specs/" * 6 + "h100.yaml"  # a title longer than the figure is wide
    figure = plan_figure(plan, "a100")
    try:
        figure.canvas.draw()
        title = figure.get_suptitle()
        assert "\n" in title and title.startswith(f"plan {plan.plan_hash[:12]}: recipe 1f1b microbatches=4")
        box, page = figure._suptitle.get_window_extent(), figure.bbox
        assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1
        timeline = figure.axes[1]
        labels = [text.get_text() for text in timeline.texts if text.get_text() != "prologue"]  # the ops before the schedule's
        actions = [str(action) for rank in range(4) for action in plan.pipeline.actions(rank) if action.kind.is_compute]
        assert len(labels) == len(set(labels)) and set(labels) <= set(actions)
        assert len(labels) >= 0.75 * len(actions), f"{len(labels)} of {len(actions)} actions labelled"  # all of them fit today
    finally:
        import matplotlib.pyplot as plt

        plt.close(figure)
