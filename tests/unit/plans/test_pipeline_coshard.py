"""Co-shard chosen per pipeline stage (``coshard_stages``, ``shards``): equivalence, the recompute groups it makes,
the activations a stashed microbatch keeps (predicted and metered), tensor-parallel stages, and bad input."""

from __future__ import annotations

import re

import pytest
import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.plans.context import PlanContext
from lightning_nnscaler.plans.pipeline import PipelineSettings, pipeline
from lightning_nnscaler.sim import predict
from support.saved import metered_peaks

SCHEDULES = ["1f1b", "gpipe", "zb1", "interleaved"]


def gpt_and_batch(heads: int = 2) -> tuple[GPT, object]:
    """Four blocks, so that two stages (four interleaved chunks) each hold some of them."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, seq_len=16, hidden=32, layers=4, heads=heads))
    model.log = lambda *args, **kwargs: None
    return model, model.example_batch(8, torch.Generator().manual_seed(0))


def predicted_activations(plan: lnn.Plan) -> list[int]:
    return [row["activations"] for row in predict(plan, "cpu").memory]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_co_sharding_the_first_stage_verifies_and_keeps_a_quarter_of_its_activations(schedule: str) -> None:
    model, batch = gpt_and_batch()
    kept = lnn.parallelize(model, batch, schedule, 2, step="training_step")
    plan = lnn.parallelize(model, batch, schedule, 2, step="training_step", coshard_stages="0", shards=2)
    report = plan.verify()  # every rank's code in one process against one device: losses and gradients, rtol 1e-5
    assert report.parameters_checked == len(list(model.parameters()))
    first, second = plan.sources
    assert "= checkpoint(" in first and "= checkpoint(" not in second
    before, after = predicted_activations(kept), predicted_activations(plan)
    assert after[0] < before[0] / 2.5 and after[1:] == before[1:]
    for rank, (predicted, measured) in enumerate(zip(after, metered_peaks(plan), strict=True)):
        assert abs(predicted / measured - 1) <= 0.10, f"rank {rank}: predicted {predicted} B, metered {measured} B"


def test_each_piece_of_each_stretch_is_its_own_recompute_group_within_its_segment() -> None:
    model, batch = gpt_and_batch()
    plan = lnn.parallelize(model, batch, "1f1b", 2, step="training_step", microbatches=2, coshard_stages="0", shards=2)
    groups: dict[tuple[int, int], set[int]] = {}
    for op in plan.planned.ops:
        if op.recompute is not None:
            assert op.segment[0] == 0 and op.device == 0  # only stage 0, on its rank
            groups.setdefault(op.segment, set()).add(op.recompute)
    assert set(groups) == {(0, 0), (0, 1)}
    assert not groups[(0, 0)] & groups[(0, 1)]  # a group never spans two segments
    # two blocks per stage, each an attention and an MLP stretch, each cut in two pieces run one after another
    assert all(len(segment_groups) == 8 for segment_groups in groups.values())
    heads = re.findall(r"checkpoint\(recompute_\d+", plan.sources[0])
    assert len(heads) == 16  # 8 pieces in each of the rank's two segments


@pytest.mark.timeout(300)
def test_a_tensor_parallel_stage_is_co_sharded_on_each_of_its_ranks() -> None:
    model, batch = gpt_and_batch(heads=4)  # tp 2 x 2 shards = 4 pieces of the heads
    plan = lnn.parallelize(model, batch, "hybrid3d", 4, step="training_step", dp=1, tp=2, pp=2, coshard_stages="1")
    plan.verify()
    assert ["= checkpoint(" in source for source in plan.sources] == [False, False, True, True]  # rank = stage * tp + piece
    plain = lnn.parallelize(model, batch, "hybrid3d", 4, step="training_step", dp=1, tp=2, pp=2)
    before, after = predicted_activations(plain), predicted_activations(plan)
    assert after[:2] == before[:2] and all(a < b for a, b in zip(after[2:], before[2:]))


def test_a_stage_both_recomputed_and_co_sharded_is_refused_naming_both_keys() -> None:
    model, batch = gpt_and_batch()
    with pytest.raises(ValueError, match=r"stage 0 is in both recompute_stages and coshard_stages; a co-sharded stage already recomputes"):
        lnn.parallelize(model, batch, "1f1b", 2, step="training_step", recompute_stages="0", coshard_stages="0,1")


def test_bad_coshard_stages_and_shards_are_refused_naming_the_key() -> None:
    model, batch = gpt_and_batch()
    with pytest.raises(ValueError, match=r"coshard_stages \[1, 1\] names a stage more than once; name each stage once"):
        lnn.parallelize(model, batch, "1f1b", 2, step="training_step", coshard_stages="1,1")
    with pytest.raises(ValueError, match=r"coshard_stages \[2\] names stage 2, outside the pipeline's 2 stages"):
        lnn.parallelize(model, batch, "1f1b", 2, step="training_step", coshard_stages="2")
    with pytest.raises(ValueError, match=r"shards must be an int >= 2 for coshard_stages \[0\], got 1"):
        lnn.parallelize(model, batch, "1f1b", 2, step="training_step", coshard_stages="0", shards=1)
    graph = lnn.trace(model, batch, step="training_step")
    with pytest.raises(ValueError, match=r"interlaced: coshard_stages is not supported"):
        pipeline(graph, PlanContext(world_size=2), "interlaced", PipelineSettings(coshard_stages=[0]))
