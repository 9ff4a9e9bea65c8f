"""plan.explain(): per-rank bytes and communication, read off the materialized program."""

from __future__ import annotations

import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.materialize import AlphaBeta
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.explain import explain_rank


def test_explain_reports_sharded_parameters_and_communication() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig.small())
    batch = model.example_batch(4)
    whole = sum(parameter.numel() * 4 for parameter in model.parameters())
    dp = lnn.parallelize(model, batch, "dp", 2, step="training_step")
    tp = lnn.parallelize(model, batch, "tp", 2, step="training_step", communication_cost=AlphaBeta(alpha=0.0, launch=0.0))
    assert explain_rank(dp.materialized, 0)["parameters"] == whole
    tp_rank = explain_rank(tp.materialized, 0)
    assert tp_rank["parameters"] < 0.75 * whole  # attention and MLP weights are halved
    assert tp_rank["optimizer"] == 2 * tp_rank["parameters"]
    assert tp_rank["communication"] > 0
    text = tp.explain()
    lines = text.split("\n")
    assert "recipe tp" in lines[0] and len(lines) == 2 + 2 + 3  # title, header, one row per rank, three footnotes
    assert lines[-3].startswith("* optimizer state assumes Adam")


def test_parallelize_reports_each_planning_stage_with_its_time() -> None:
    model = GPT(GPTConfig.small())
    lines: list[str] = []
    lnn.parallelize(model, model.example_batch(4, torch.Generator().manual_seed(0)), "1f1b", 2, step="training_step", progress=lines.append)
    assert [line.split(" ")[0] for line in lines] == ["tracing", "tracing", "planning", "planning", "materializing", "materializing"]
    assert lines[1].startswith("tracing GPT.training_step: done in ") and lines[1].endswith(" s")
    assert "with recipe 1f1b for 2 ranks" in lines[2] and "generating 2 modules" in lines[4]
