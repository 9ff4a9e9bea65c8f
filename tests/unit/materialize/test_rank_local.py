"""``materialize(rank=)``: one rank's program, built alone, is that rank's part of every rank's materialization.

A rank-local materialization builds rank ``r``'s program whole and of the other ranks only their messages with ``r``
and their collectives; ``parallelize(rank=r)`` generates ``r``'s module from it. These tests hold it, for every rank of
a replicated pipeline (dp 2 × tp 2 × pp 2, 8 ranks), to the whole materialization and to full planning's code.
"""

from __future__ import annotations

import dataclasses
import pickle

import pytest

import lightning_nnscaler as lnn
from lightning_nnscaler.codegen.sources import RankSources
from lightning_nnscaler.materialize.dependencies import materialize
from lightning_nnscaler.materialize.program import Collective, Compute, Recv, Send
from lightning_nnscaler.materialize.steps import check_message_order, step_program
from support.rank_plans import gpt_plan
from lightning_nnscaler.program import BUCKET_BYTES

WORLD_SIZE = 8


@pytest.fixture(scope="module")
def full() -> lnn.Plan:
    """dp 2 × tp 2 × pp 2 (hybrid3d, 2 microbatches), every rank planned."""
    return gpt_plan("hybrid3d", WORLD_SIZE, dp=2, tp=2, pp=2)


def _messages_with(actions: list, rank: int) -> list:
    """The point-to-point messages in ``actions`` whose peer is ``rank``, in order, their variables left out (another
    rank's variables are not named in a materialization that does not build its code)."""
    return [
        dataclasses.replace(action, source_var="") if isinstance(action, Send) else dataclasses.replace(action, var="")
        for action in actions if isinstance(action, (Send, Recv)) and (action.dst if isinstance(action, Send) else action.src) == rank
    ]


def _collectives(actions: list) -> list[tuple]:
    """Each collective in ``actions`` as (position, kind, ranks, segment)."""
    return [(action.position, action.kind, action.ranks, action.segment) for action in actions if isinstance(action, Collective)]


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
def test_a_ranks_own_materialization_is_its_part_of_every_ranks(full: lnn.Plan, rank: int) -> None:
    local = materialize(full.planned, WORLD_SIZE, validate=False, rank=rank)
    whole = full.materialized
    assert local.local_rank == rank and whole.local_rank is None
    assert local.ranks[rank] == whole.ranks[rank]  # inputs, actions (names, tags, positions) and outputs
    assert local.gradient_groups == whole.gradient_groups and local.communication_groups == whole.communication_groups
    assert local.value_shapes == whole.value_shapes and local.pipelined
    for other in local.ranks:
        if other.rank != rank:  # no compute of other ranks: their messages with this rank, and collectives
            assert not any(isinstance(action, Compute) for action in other.actions)
            assert _messages_with(other.actions, rank) == _messages_with(whole.ranks[other.rank].actions, rank)
            assert _collectives(other.actions) == _collectives(whole.ranks[other.rank].actions)


def test_each_rank_checks_the_message_order_of_its_own_channels(full: lnn.Plan) -> None:
    lists = [full.pipeline.actions(each) for each in range(WORLD_SIZE)]
    for rank in (0, 5):
        local = materialize(full.planned, WORLD_SIZE, validate=False, rank=rank)
        steps = step_program(local, lists, {}, bucket_bytes=BUCKET_BYTES)
        assert steps.actions[rank] == full.program.actions[rank]
        check_message_order(local, steps)  # its channels pair in order


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
def test_planning_one_rank_writes_the_module_full_planning_writes_for_it(full: lnn.Plan, rank: int) -> None:
    local = gpt_plan("hybrid3d", WORLD_SIZE, rank, dp=2, tp=2, pp=2)
    assert local.lowered.materialized.local_rank == rank and local.sources.generated() == [rank]
    assert local.plan_hash == full.plan_hash
    assert local.sources[rank] == full.sources[rank]


def test_a_plan_that_does_not_pipeline_is_materialized_whole_for_one_rank() -> None:
    plan = gpt_plan("hybrid", 4, 1, dp=2, tp=2)  # early sends read each sender's whole program
    assert plan.lowered.materialized.local_rank is None
    assert plan.sources[1] == gpt_plan("hybrid", 4, dp=2, tp=2).sources[1]


def test_a_rank_local_plans_parts_pickle_as_every_ranks(full: lnn.Plan) -> None:
    local = gpt_plan("hybrid3d", WORLD_SIZE, 2, dp=2, tp=2, pp=2)
    copy = pickle.loads(pickle.dumps(local.lowered))
    assert copy.materialized.local_rank is None and copy.steps == full.program
    assert list(RankSources(copy, local.plan_hash[:12], local.sources.label)) == list(full.sources)
