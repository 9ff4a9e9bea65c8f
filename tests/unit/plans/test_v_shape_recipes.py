"""ZB-V, V-Half and DualPipeV as catalog recipes: two stages per rank in a V, verified against one device at 8 virtual ranks."""

from __future__ import annotations

import pytest
import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.schedules import dual_pipe_v


@pytest.mark.parametrize("recipe", ["zbv", "vhalf", "dualpipev"])
def test_v_shaped_recipes_verify_at_8_virtual_ranks(recipe: str) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=8, hidden=32, layers=16, heads=2))
    plan = lnn.parallelize(model, model.example_batch(16), recipe, 8, step="training_step")
    assert plan.pipeline is not None and plan.pipeline.schedule.stages == 16  # two model stages per rank
    if recipe == "dualpipev":  # at least one microbatch per stage: all 16 rows
        assert plan.pipeline.schedule == dual_pipe_v(8, 16)
    report = plan.verify()
    assert report.loss == pytest.approx(report.reference_loss, rel=1e-5)
    assert report.max_gradient_difference < 1e-5


def small_gpt(rows: int) -> tuple[GPT, object]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=8, hidden=32, layers=4, heads=2))
    return model, model.example_batch(rows)


def test_dualpipev_defaults_to_two_microbatches_per_rank_and_refuses_fewer() -> None:
    model, batch = small_gpt(8)
    plan = lnn.parallelize(model, batch, "dualpipev", 2, step="training_step", layers_per_stage="1,1,1,1")
    assert plan.pipeline.schedule == dual_pipe_v(2, 4)  # zbv's default would be 2, the smallest divisor >= 2 ranks
    plan.verify()
    with pytest.raises(ValueError, match=r"dualpipev: microbatches must be an integer >= 2 × ranks = 4 \(one per stage\), got 2"):
        lnn.parallelize(model, batch, "dualpipev", 2, step="training_step", microbatches=2)
    small_model, small_batch = small_gpt(2)  # a batch of 2 rows cannot give 4 microbatches
    with pytest.raises(ValueError, match=r"dualpipev: microbatches must be an integer >= 2 × ranks = 4 \(one per stage\), got 2"):
        lnn.parallelize(small_model, small_batch, "dualpipev", 2, step="training_step")
