"""Lowering inserts RECV before and SEND after each compute action whose neighbour stage is on another rank."""

from __future__ import annotations

import pytest

from lightning_nnscaler.schedules import Schedule, ScheduleError, lower, one_f_one_b, validate


def test_lower_one_f_one_b_two_stages() -> None:
    assert lower(one_f_one_b(2, 2)).as_text() == [
        ["0F0", "0SEND_F0->1", "0F1", "0SEND_F1->1", "0RECV_B0<-1", "0B0", "0RECV_B1<-1", "0B1"],
        ["1RECV_F0<-0", "1F0", "1B0", "1SEND_B0->0", "1RECV_F1<-0", "1F1", "1B1", "1SEND_B1->0"],
    ]


def test_lower_middle_stage_receives_and_sends_both_ways() -> None:
    middle = lower(one_f_one_b(3, 1)).as_text()[1]
    assert middle == ["1RECV_F0<-0", "1F0", "1SEND_F0->2", "1RECV_B0<-2", "1B0", "1SEND_B0->0"]


def test_lower_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="compute-only"):
        lower(lower(one_f_one_b(2, 2)))


def test_lowered_schedule_with_a_receive_missing_is_rejected() -> None:
    text = lower(one_f_one_b(2, 1)).as_text()
    text[1].remove("1RECV_F0<-0")
    with pytest.raises(ScheduleError, match=r"missing actions \[1RECV_F0<-0\]\n"):
        validate(Schedule.from_text(text, [0, 1], 1))
