"""A rank that dies mid-step makes the others fail fast; nothing hangs."""

from __future__ import annotations

import pytest

from lightning_nnscaler.launch import LaunchError, launch

from workers import die_mid_step, raise_on_rank_1  # noqa: E402 - tests/integration is on sys.path


@pytest.mark.timeout(180)
def test_a_dead_rank_makes_the_others_exit_with_an_error_within_60_seconds() -> None:
    survivor, _ = launch(die_mid_step, 2, timeout=170)
    error, seconds = survivor
    assert error == "CommunicationError"
    assert seconds < 60


@pytest.mark.timeout(180)
def test_a_rank_that_raises_is_named_last_with_its_error_and_its_peers_say_why_they_stopped() -> None:
    with pytest.raises(LaunchError) as failure:
        launch(raise_on_rank_1, 2, timeout=170)
    message = str(failure.value)
    assert message.splitlines()[-1].startswith("rank 1 failed first: ValueError: boom from rank 1 (in raise_on_rank_1, workers.py line"), message
    assert "rank 0 stopped: waiting for rank 1, which failed: ValueError: boom from rank 1" in message, message
    assert message.count("Traceback (most recent call last)") == 1, message
