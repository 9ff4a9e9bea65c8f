"""ZB-V and V-Half as catalog recipes: two stages per rank in a V, verified against one device at 8 virtual ranks."""

from __future__ import annotations

import pytest
import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.models.gpt import GPT, GPTConfig


@pytest.mark.parametrize("recipe", ["zbv", "vhalf"])
def test_v_shaped_recipes_verify_at_8_virtual_ranks(recipe: str) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=8, hidden=32, layers=16, heads=2))
    plan = lnn.parallelize(model, model.example_batch(16), recipe, 8, step="training_step")
    assert plan.pipeline is not None and plan.pipeline.schedule.stages == 16  # two model stages per rank
    report = plan.verify()
    assert report.loss == pytest.approx(report.reference_loss, rel=1e-5)
    assert report.max_gradient_difference < 1e-5
