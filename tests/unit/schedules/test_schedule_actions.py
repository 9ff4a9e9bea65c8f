"""Action text form and Schedule construction."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_nnscaler.schedules import Action, Kind, Schedule

COMPUTE = [kind for kind in Kind if kind.is_compute]
COMMUNICATION = [kind for kind in Kind if kind.is_send or kind.is_recv]
BUCKET_KINDS = [kind for kind in Kind if kind.names_bucket]
INDEX = st.integers(min_value=0, max_value=10_000)

ACTIONS = st.one_of(
    st.builds(Action, INDEX, INDEX, st.sampled_from(COMPUTE)),
    st.builds(Action, INDEX, INDEX, st.sampled_from(COMMUNICATION), INDEX),
    st.builds(Action.step, st.sampled_from(BUCKET_KINDS), INDEX),
    st.builds(Action.step, st.sampled_from([Kind.LOSS, Kind.STEP])),
)


@given(ACTIONS)
def test_parse_round_trips_every_kind(action: Action) -> None:
    assert Action.parse(str(action)) == action


@pytest.mark.parametrize(
    ("text", "action"),
    [
        ("1F0", Action(1, 0, Kind.FORWARD)),
        ("0B3", Action(0, 3, Kind.BACKWARD)),
        ("2W11", Action(2, 11, Kind.WEIGHT)),
        ("0SEND_F3->1", Action(0, 3, Kind.SEND_F, 1)),
        ("1RECV_F3<-0", Action(1, 3, Kind.RECV_F, 0)),
        ("1SEND_B3->0", Action(1, 3, Kind.SEND_B, 0)),
        ("0RECV_B3<-1", Action(0, 3, Kind.RECV_B, 1)),
        ("REDUCE b2", Action.step(Kind.REDUCE, 2)),
        ("GATHER b0", Action.step(Kind.GATHER, 0)),
        ("FREE b1", Action.step(Kind.FREE, 1)),
        ("LOSS", Action.step(Kind.LOSS)),
        ("STEP", Action.step(Kind.STEP)),
    ],
)
def test_compact_text_form(text: str, action: Action) -> None:
    assert Action.parse(text) == action
    assert str(action) == text


@pytest.mark.parametrize("text", ["F0", "1X0", "1F", "1F0->1", "0SEND_F0<-1", "0RECV_B0->1", "0SEND_F0", "1F0 2F0"])
def test_parse_rejects_malformed_text(text: str) -> None:
    with pytest.raises(ValueError, match="cannot parse action"):
        Action.parse(text)


def test_peer_only_on_communication() -> None:
    with pytest.raises(ValueError, match="takes no peer"):
        Action(0, 0, Kind.FORWARD, 1)
    with pytest.raises(ValueError, match="needs a peer"):
        Action(0, 0, Kind.SEND_F)


def test_schedule_from_text_and_placement() -> None:
    schedule = Schedule.from_text([["0F0", "2F0", "2B0", "0B0"], ["1F0", "3F0", "3B0", "1B0"]], [0, 1, 0, 1], 1)
    assert schedule.as_text() == [["0F0", "2F0", "2B0", "0B0"], ["1F0", "3F0", "3B0", "1B0"]]
    assert (schedule.world_size, schedule.stages, schedule.splits_backward) == (2, 4, False)
    assert schedule.stages_of_rank(1) == [1, 3]


def test_schedule_rejects_stage_on_missing_rank() -> None:
    with pytest.raises(ValueError, match="outside the 1 ranks"):
        Schedule.from_text([["0F0"]], [0, 1], 1)
