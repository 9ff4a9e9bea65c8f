"""A rank that dies mid-step makes the others fail fast; nothing hangs."""

from __future__ import annotations

import pytest

from lightning_nnscaler.launch import launch

from workers import die_mid_step  # noqa: E402 - tests/integration is on sys.path


@pytest.mark.timeout(180)
def test_a_dead_rank_makes_the_others_exit_with_an_error_within_60_seconds() -> None:
    survivor, _ = launch(die_mid_step, 2, timeout=170)
    error, seconds = survivor
    assert error == "CommunicationError"
    assert seconds < 60
