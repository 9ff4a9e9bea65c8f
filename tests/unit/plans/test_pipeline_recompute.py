"""Activation recompute chosen per pipeline stage (``recompute_stages``): equivalence, where the
checkpointed blocks are, the activation peak it saves (predicted and metered), and bad input."""

from __future__ import annotations

import re

import pytest
import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.plans.context import PlanContext
from lightning_nnscaler.plans.catalog import RecipeError, load_recipe
from lightning_nnscaler.plans.pipeline import PipelineSettings, pipeline
from lightning_nnscaler.sim import predict
from support.saved import metered_peaks

SCHEDULES = ["1f1b", "gpipe", "zb1", "interleaved"]


def gpt_and_batch() -> tuple[GPT, object]:
    """Four blocks, so that four stages (eight interleaved chunks) each hold some of them."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, seq_len=16, hidden=32, layers=4, heads=2))
    model.log = lambda *args, **kwargs: None
    return model, model.example_batch(8, torch.Generator().manual_seed(0))


def checkpointed_blocks(source: str) -> dict[str, int]:
    """Per segment function of a rank's module, how many checkpointed blocks it calls."""
    functions = re.split(r"^def ", source, flags=re.M)[1:]
    return {
        function.split("(", 1)[0]: len(re.findall(r"= checkpoint\(recompute_\d+(?:_\d+)?,", function))
        for function in functions if re.match(r"stage\d+_microbatch\d+\(", function)
    }


def predicted_activations(plan: lnn.Plan) -> list[int]:
    return [row["activations"] for row in predict(plan, "cpu").memory]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_recomputing_the_first_stage_verifies_checkpoints_only_there_and_lowers_its_peak(schedule: str, world_size: int) -> None:
    model, batch = gpt_and_batch()
    kept = lnn.parallelize(model, batch, schedule, world_size, step="training_step")
    plan = lnn.parallelize(model, batch, schedule, world_size, step="training_step", recompute_stages="0")
    report = plan.verify()  # every rank's code in one process against one device: losses and gradients, rtol 1e-5
    assert report.parameters_checked == len(list(model.parameters()))

    first, *others = [checkpointed_blocks(source) for source in plan.sources]
    assert first and all(blocks >= 1 for blocks in first.values())  # every segment of rank 0 (both chunks, interleaved)
    if schedule != "interleaved":  # its chunks are cut inside a block: two tensors cross, and a block ends at each send
        assert set(first.values()) == {1}  # one block per (stage, microbatch): none crosses a segment boundary
    assert all(blocks == 0 for segments in others for blocks in segments.values())

    before, after = predicted_activations(kept), predicted_activations(plan)
    assert after[0] < before[0] / 4 and after[1:] == before[1:]
    metered = metered_peaks(plan)
    for rank, (predicted, measured) in enumerate(zip(after, metered, strict=True)):
        assert abs(predicted / measured - 1) <= 0.10, f"rank {rank}: predicted {predicted} B, metered {measured} B"


@pytest.mark.timeout(300)
def test_hybrid3d_recomputes_a_tensor_parallel_stage_on_each_of_its_ranks() -> None:
    model, batch = gpt_and_batch()
    plan = lnn.parallelize(model, batch, "hybrid3d", 4, step="training_step", dp=1, tp=2, pp=2, recompute_stages="1")
    plan.verify()
    blocks = [sum(checkpointed_blocks(source).values()) for source in plan.sources]
    assert blocks[0] == blocks[1] == 0 and blocks[2] > 0 and blocks[3] > 0  # rank = stage * tp + piece


def test_each_segment_of_a_recomputed_stage_is_its_own_group_and_no_grad_or_prologue_ops_are_not() -> None:
    model, batch = gpt_and_batch()
    plan = lnn.parallelize(model, batch, "1f1b", 2, step="training_step", microbatches=4, recompute_stages="0")
    groups: dict[tuple[int, int], set[int | None]] = {}
    for op in plan.planned.ops:
        groups.setdefault(op.segment, set()).add(None if op.no_grad else op.recompute)
    assert groups.pop((-1, 0)) == {None}  # the prologue
    assert {segment: group for segment, group in groups.items() if segment[0] == 1} == {(1, m): {None} for m in range(4)}
    assert sorted(groups[(0, m)] for m in range(4)) == [{0}, {1}, {2}, {3}]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0,x", r"recipe '1f1b': parameter 'recompute_stages' expects tuple\[int, \.\.\.\]: a list such as \[3, 3, 2\] or a "
                r"comma-separated string such as '3,3,2', got str '0,x'"),
        ("-1", r"recipe '1f1b': parameter 'recompute_stages' has entry -1 in '-1'; each entry must be int >= 0, or None"),
        ([0, -1], r"parameter 'recompute_stages' has entry -1 in \[0, -1\]; each entry must be int >= 0"),
        ([0, True], r"parameter 'recompute_stages' expects tuple\[int, \.\.\.\].*got list \[0, True\]"),
    ],
)
def test_recompute_stages_that_are_not_stage_indices_are_refused_naming_the_key(text: object, message: str) -> None:
    with pytest.raises(RecipeError, match=message):
        load_recipe("1f1b").check_parameters({"recompute_stages": text})


def test_a_stage_named_twice_is_refused_naming_the_key() -> None:
    model, batch = gpt_and_batch()
    with pytest.raises(ValueError, match=r"recompute_stages \[0, 0\] names a stage more than once; name each stage once"):
        lnn.parallelize(model, batch, "1f1b", 2, step="training_step", recompute_stages="0,0")


def test_a_stage_outside_the_pipeline_is_refused_naming_the_key() -> None:
    model, batch = gpt_and_batch()
    with pytest.raises(ValueError, match=r"recompute_stages \[0, 2\] names stage 2, outside the pipeline's 2 stages \(0 to 1"):
        lnn.parallelize(model, batch, "1f1b", 2, step="training_step", recompute_stages="0,2")
    with pytest.raises(ValueError, match=r"recompute_stages \[2\] names stage 2, outside .* a stage is a pipeline rank and all its chunks"):
        lnn.parallelize(model, batch, "interleaved", 2, step="training_step", recompute_stages="2")  # 4 chunks, 2 ranks


@pytest.mark.parametrize("schedule", ["3f1b", "interlaced"])
def test_schedules_without_stages_of_their_own_refuse_recompute_stages(schedule: str) -> None:
    model, batch = gpt_and_batch()
    graph = lnn.trace(model, batch, step="training_step")
    with pytest.raises(ValueError, match=rf"{schedule}: recompute_stages is not supported .* use it with gpipe, 1f1b, zb1, interleaved or hybrid3d"):
        pipeline(graph, PlanContext(world_size=2), schedule, PipelineSettings(recompute_stages=[0]))
