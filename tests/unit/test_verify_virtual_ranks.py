"""plan.verify(): every rank's generated code, run in one process, equals single-device training."""

from __future__ import annotations

import pytest
import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.models.mbart import MBart, MBartConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def wide_gpt() -> tuple[GPT, tuple]:
    """A one-layer GPT whose heads (64), FFN (256), sequence (32) and batch (32) divide 32 ranks x 2 shards."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=32, hidden=128, layers=1, heads=64, ffn_hidden=256))
    return model, model.example_batch(32, torch.Generator().manual_seed(0))


def recipe_params(recipe: str, world_size: int) -> dict:
    if recipe == "coshard":
        return {"shards": 2}
    if recipe == "hybrid":
        return {"dp": 4 if world_size >= 16 else 2, "tp": world_size // (4 if world_size >= 16 else 2)}
    return {}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [8, 16, 32])
@pytest.mark.parametrize("recipe", ["dp", "zero1", "zero3", "tp", "sp", "coshard", "hybrid"])
def test_gpt_plans_verify_at_many_virtual_ranks(recipe: str, world_size: int) -> None:
    model, batch = wide_gpt()
    plan = lnn.parallelize(model, batch, recipe, world_size, step="training_step", **recipe_params(recipe, world_size))
    report = plan.verify()
    assert report.world_size == world_size
    assert report.parameters_checked == sum(1 for _ in model.parameters())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [8, 16, 32])
def test_mbart_tensor_parallel_verifies(world_size: int) -> None:
    torch.manual_seed(0)
    model = MBart(MBartConfig(vocab_size=256, seq_len=8, hidden=64, encoder_layers=1, decoder_layers=1, heads=32, ffn_hidden=128))
    batch = model.example_batch(2, torch.Generator().manual_seed(0))
    report = lnn.parallelize(model, batch, "tp", world_size, step="training_step").verify()
    assert report.parameters_checked == sum(1 for _ in model.parameters())


def test_a_plan_refuses_a_world_of_another_size() -> None:
    model, batch = wide_gpt()
    plan = lnn.parallelize(model, batch, "tp", 2, step="training_step")
    from lightning_nnscaler.codegen import module_from_source
    from lightning_nnscaler.runtime.executor import RankExecutor
    from lightning_nnscaler.runtime.memory_comm import run_ranks

    def run(communicator):
        module = module_from_source(plan.sources[min(communicator.rank, 1)], "wrong_world")
        return RankExecutor(module, communicator.rank, dict(model.named_parameters()), {}, communicator)

    with pytest.raises(ValueError, match="2-rank plan.*plan again with world_size=4"):
        run_ranks(4, run, timeout=10)


def test_an_unplaced_op_is_refused_before_code_exists() -> None:
    model, batch = wide_gpt()
    graph = lnn.trace(model, batch, step="training_step")
    planned = graph.copy()
    for op in planned.ops[1:]:
        lnn.op_assign(planned, op, 0)
    with pytest.raises(lnn.ir.validate.UnassignedOpError, match=graph.ops[0].name):
        lnn.build_plan(model, batch, "training_step", graph, planned, 1)
