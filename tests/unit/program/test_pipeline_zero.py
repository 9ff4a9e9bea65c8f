"""ZeRO inside pipelines (``hybrid3d`` / ``1f1b`` / ``gpipe`` / ``zb1`` with ``zero=1`` or ``3``): each stage's
data-parallel replicas shard its optimizer state (1) or its parameters too (3); the gradients accumulate over the
microbatches in the full-size boxes and are reduce-scattered once, after the stage's last backward."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from support.held import one_step

pytestmark = pytest.mark.usefixtures("one_thread")

BUCKET_BYTES = 4096
"""Small buckets: every rank reduce-scatters and gathers several."""


def gpt(layers: int = 2) -> tuple[GPT, Any]:
    """A small GPT and a batch of 16 (4 microbatches per replica at up to 4 replicas)."""
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(GPTConfig.small(), layers=layers))
    return model, model.example_batch(16, torch.Generator().manual_seed(0))


def plan_of(recipe: str, world_size: int, layers: int = 2, **params: Any) -> lnn.Plan:
    model, batch = gpt(layers)
    return lnn.parallelize(model, batch, recipe, world_size, step="training_step", bucket_bytes=BUCKET_BYTES, microbatches=4, **params)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("recipe", "world_size", "layers", "params"), [
    ("hybrid3d", 4, 2, {"dp": 2, "pp": 2, "zero": 1}),
    ("hybrid3d", 4, 2, {"dp": 2, "pp": 2, "zero": 3}),
    ("hybrid3d", 8, 2, {"dp": 2, "tp": 2, "pp": 2, "zero": 3}),
    ("1f1b", 4, 2, {"stages": 2, "zero": 3}),
    ("1f1b", 8, 4, {"stages": 4, "zero": 3}),
    ("1f1b", 8, 2, {"stages": 2, "zero": 1}),
    ("gpipe", 4, 2, {"stages": 2, "zero": 3}),
    ("zb1", 4, 2, {"stages": 2, "zero": 3}),
], ids=lambda value: str(value))
def test_a_pipeline_with_zero_trains_as_one_device(recipe: str, world_size: int, layers: int, params: dict) -> None:
    plan = plan_of(recipe, world_size, layers, **params)
    assert plan.program.zero_stage == params["zero"]
    assert any(action.microbatch == 3 for action in plan.program.actions[0])  # 4 microbatches really run
    report = plan.verify()  # losses and every parameter's gradient against single-device, rtol 1e-5
    assert report.parameters_checked == sum(1 for _ in plan.module.parameters())
    assert report.loss == pytest.approx(report.reference_loss, rel=1e-5)


@pytest.mark.parametrize("zero", [1, 3])
def test_each_stage_reduce_scatters_once_after_its_last_backward(zero: int) -> None:
    plan = plan_of("hybrid3d", 4, dp=2, pp=2, zero=zero)
    for rank, texts in enumerate(plan.program.as_text()):
        buckets = len(plan.program.buckets[rank])
        assert buckets >= 2
        last_backward = max(index for index, text in enumerate(texts) if text[1:].startswith("B"))
        reduces = [index for index, text in enumerate(texts) if text.startswith("REDUCE")]
        assert len(reduces) == buckets and min(reduces) > last_backward, (rank, texts)  # once, after every microbatch's B
        gathers = [index for index, text in enumerate(texts) if text.startswith("GATHER")]
        frees = [index for index, text in enumerate(texts) if text.startswith("FREE")]
        step = texts.index("STEP")
        if zero == 3:  # gathered before the first action (a RECV_F too), freed after the sums, before the step
            assert gathers == list(range(buckets)) and len(frees) == buckets and min(frees) > max(reduces) and max(frees) < step
        else:  # the updated chunks gathered back after the step
            assert not frees and len(gathers) == buckets and min(gathers) > step


def held_at_rest(plan: lnn.Plan) -> list[dict[str, int]]:
    """Per rank, after one training step and Adam's step (in-memory ranks): the bytes of its parameters (boxes and
    owned chunks), their gradients, Adam's moments, and the most box bytes gathered while the step ran."""
    return one_step(plan)


def test_hybrid3d_zero_shards_each_stage_over_its_replicas() -> None:
    """dp 2 x pp 2: under zero=3 a rank holds at rest half its stage's parameters (and gradients), under zero=1
    half its stage's optimizer state; the whole stage is gathered only while the step runs."""
    held = {zero: held_at_rest(plan_of("hybrid3d", 4, dp=2, pp=2, zero=zero)) for zero in (0, 1, 3)}
    for rank in range(4):
        stage, one, three = held[0][rank], held[1][rank], held[3][rank]
        slack = 4 * 64  # the chunks' padding: under 2 elements of 4 bytes per box (a stage has under 32 boxes)
        # zero=3: a rank's parameters, gradients and Adam moments at rest are its half of the stage's
        assert stage["parameters"] / 2 <= three["parameters"] <= stage["parameters"] / 2 + slack, (rank, stage, three)
        assert stage["gradients"] / 2 <= three["gradients"] <= stage["gradients"] / 2 + slack, (rank, stage, three)
        assert stage["optimizer"] / 2 <= three["optimizer"] <= stage["optimizer"] / 2 + 2 * slack, (rank, stage, three)
        assert three["gathered"] == stage["parameters"]  # the stage's boxes, gathered for its microbatches
        # zero=1: whole parameters, half the optimizer state
        assert one["parameters"] == stage["parameters"] + three["parameters"]  # the boxes and the owned chunks
        assert stage["optimizer"] / 2 <= one["optimizer"] <= stage["optimizer"] / 2 + 2 * slack, (rank, stage, one)
    whole = sum(parameter.numel() * 4 for parameter in gpt()[0].parameters())
    assert sum(held[0][rank]["parameters"] for rank in (0, 1)) == whole  # the two stages of a replica are the model


def test_zero_over_microbatches_with_several_stages_per_rank_is_refused() -> None:
    with pytest.raises(lnn.PlanError, match=r"ZeRO stage 3 with several microbatches per step on a schedule where rank 0 runs several stages.*1f1b, gpipe, zb1, hybrid3d"):
        plan_zero_interleaved()


def plan_zero_interleaved() -> None:
    """An interleaved pipeline (two stages per rank, 4 microbatches) built with ZeRO-3."""
    from lightning_nnscaler.capture.trace import trace_step
    from lightning_nnscaler.plan import build_plan
    from lightning_nnscaler.plans.catalog import apply_recipe

    model, batch = gpt(layers=4)
    graph = trace_step(model, batch, 0, step="training_step").graph
    planned = graph.copy()
    context = apply_recipe(planned, "interleaved", 2, microbatches=4, virtual_stages=2)
    build_plan(model, batch, "training_step", graph, planned, 2, zero_stage=3, validated=True, layout=context.layout, pipeline=context.pipeline)


def test_zero_2_is_refused_naming_the_recipe() -> None:
    with pytest.raises(Exception, match=r"hybrid3d: zero must be 0, 1 or 3"):
        plan_of("hybrid3d", 4, dp=2, pp=2, zero=2)


def test_the_whole_lowering_of_a_zero3_1f1b_with_a_bucket_over_both_stages() -> None:
    """On literal text: rank 1 gathers before its first RECV_F, and reduce-scatters after the SEND_B of its last
    backward (blocking collectives: rank 0 gathers first and waits for that message). The bucket b1 is a box both
    stages' ranks sum (a tied weight): each rank reaches its GATHER and REDUCE without waiting on the other."""
    from lightning_nnscaler.program import Action, Bucket, SegmentPeers, lower_step

    lists = [[Action.parse(text) for text in rank.split()] for rank in ("0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1")]
    peers = {(0, (0, m)): SegmentPeers(outputs=(1,), gradient_outputs=(1,)) for m in (0, 1)}
    peers |= {(1, (1, m)): SegmentPeers(inputs=(0,), gradient_inputs=(0,)) for m in (0, 1)}
    buckets = [(Bucket((0, 2), ("0",), 8, 0), Bucket((0, 1), ("1",), 8, 0)), (Bucket((1, 3), ("0",), 8, 1), Bucket((0, 1), ("1",), 8, 1))]
    program = lower_step(lists, lambda rank, segment: peers.get((rank, segment), SegmentPeers()), buckets, pipelined=True, zero_stage=3)
    assert [", ".join(rank) for rank in program.as_text()] == [
        "GATHER b0, GATHER b1, 0F0, 0SEND_F0->1, 0F1, 0SEND_F1->1, 0RECV_B0<-1, 0B0, 0RECV_B1<-1, 0B1, REDUCE b0, REDUCE b1, LOSS, "
        "FREE b0, FREE b1, STEP",
        "GATHER b0, GATHER b1, 1RECV_F0<-0, 1F0, 1B0, 1SEND_B0->0, 1RECV_F1<-0, 1F1, 1B1, 1SEND_B1->0, REDUCE b0, REDUCE b1, LOSS, "
        "FREE b0, FREE b1, STEP",
    ]
