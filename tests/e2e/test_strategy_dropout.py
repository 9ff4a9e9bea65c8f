"""Dropout 0.1 under the Trainer: dp, tp and coshard draw the same masks (equal losses step by step),
and a run resumed from a checkpoint draws what the uninterrupted run drew."""

from __future__ import annotations

import pytest

from support.ranks import launch_ranks

from dropout_runs import STEPS_PER_EPOCH, dropout_worker  # noqa: E402 - tests/e2e is on sys.path


@pytest.mark.timeout(420)
def test_dropout_losses_are_the_same_under_every_plan_and_after_resuming(tmp_path) -> None:
    runs = launch_ranks(dropout_worker, 2, str(tmp_path), timeout=400)[0]
    dp, tp, coshard, resumed = runs["nnscaler"], runs["nnscaler_tp"], runs["nnscaler_coshard"], runs["nnscaler resumed"]
    assert len(dp) == len(tp) == len(coshard) == 2 * STEPS_PER_EPOCH
    assert tp == pytest.approx(dp, rel=1e-5) and coshard == pytest.approx(dp, rel=1e-5)
    assert resumed == pytest.approx(dp[STEPS_PER_EPOCH:], rel=1e-5)  # steps 6-10 from the step-5 checkpoint
