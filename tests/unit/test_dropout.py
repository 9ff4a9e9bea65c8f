"""Dropout and stochastic depth under every plan: the same masks whatever the plan (``ir.randomness``)."""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch
from torch import nn

import lightning_nnscaler as lnn
from lightning_nnscaler.ir import fused_random
from lightning_nnscaler.ir.randomness import RANDOM_LIKE_OP, RandomStream, op_key, random_box, using_stream
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.models.swin import Swin, SwinConfig

pytestmark = pytest.mark.usefixtures("one_thread")


@functools.lru_cache(maxsize=None)
def dropout_gpt() -> tuple[GPT, tuple]:
    """One layer, 16 heads: 8 ranks x 2 co-shards divide its heads; dropout 0.1 everywhere (attention too)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=64, layers=1, heads=16, dropout=0.1))
    return model, model.example_batch(8, torch.Generator().manual_seed(0))


@functools.lru_cache(maxsize=None)
def drop_path_swin() -> tuple[Swin, tuple]:
    torch.manual_seed(0)
    model = Swin(dataclasses.replace(SwinConfig.small(), heads=(8, 16), drop_path=0.1, dropout=0.1))
    return model, model.example_batch(4, torch.Generator().manual_seed(0))


def recipe_params(recipe: str) -> dict:
    return {"shards": 2} if recipe == "coshard" else {}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [4, 8])
@pytest.mark.parametrize("recipe", ["dp", "tp", "sp", "coshard", "zero3"])
def test_gpt_with_dropout_verifies_under_every_plan(recipe: str, world_size: int) -> None:
    model, batch = dropout_gpt()
    plan = lnn.parallelize(model, batch, recipe, world_size, step="training_step", **recipe_params(recipe))
    assert any(op.target == RANDOM_LIKE_OP for op in plan.graph.ops)
    plan.verify()


class HuggingFaceGPT2(nn.Module):
    """Hugging Face's GPT-2 from its default configuration (dropout 0.1 everywhere), tiny sizes."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        self.model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        return nn.functional.cross_entropy(self.model(tokens).logits.reshape(-1, 64), targets.reshape(-1))


@pytest.mark.timeout(300)
def test_hugging_face_gpt2_default_dropout_verifies_under_tp() -> None:
    torch.manual_seed(0)
    model = HuggingFaceGPT2().train()
    assert model.model.config.resid_pdrop == model.model.config.attn_pdrop == model.model.config.embd_pdrop == 0.1
    batch = (torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16)))
    plan = lnn.parallelize(model, batch, "tp", 2, step="training_step")
    assert any(op.target == RANDOM_LIKE_OP for op in plan.graph.ops)
    held = [line for line in plan.sources[0].splitlines() if "mlp.c_fc.weight'" in line]
    assert held and all("(0, 64)" in line for line in held)  # Conv1D (addmm) layers split like linears: 64 of 128 columns
    plan.verify()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("recipe", ["tp", "coshard"])
def test_swin_with_drop_path_verifies(recipe: str) -> None:
    model, batch = drop_path_swin()
    plan = lnn.parallelize(model, batch, recipe, 4, step="training_step", **recipe_params(recipe))
    assert any("bernoulli" in op.name and op.target == RANDOM_LIKE_OP for op in plan.graph.ops)
    plan.verify()


def test_split_random_ops_draw_only_their_box() -> None:
    model, batch = dropout_gpt()
    plan = lnn.parallelize(model, batch, "dp", 4, step="training_step")
    pieces = [op for op in plan.planned.ops if op.target == RANDOM_LIKE_OP]
    assert pieces and all(op.outputs[0].shape[0] == 2 for op in pieces)  # a quarter of the batch each
    assert sorted({op.args[1][0] for op in pieces}) == [0, 2, 4, 6]  # their offsets in the full tensor


def test_dropped_fraction_is_p_within_three_standard_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fused_random.ENVIRONMENT, "0")  # the eager draw (no compile here): test_fused_random shows the fused one equal
    p, count = 0.1, 1 << 20
    uniform = random_box([count], [0], [count], op_key("dropout"))
    dropped = (uniform < p).double().mean().item()
    assert abs(dropped - p) < 3 * math.sqrt(p * (1 - p) / count)
    normal = random_box([count], [0], [count], op_key("noise"), "normal")
    assert abs(normal.mean().item()) < 0.01 and abs(normal.std().item() - 1) < 0.01


def test_masks_differ_between_steps_draws_seeds_and_ops() -> None:
    def mask(key: str, stream: RandomStream) -> torch.Tensor:
        with using_stream(stream):
            return random_box([64, 64], [0, 0], [64, 64], op_key(key)) < 0.5

    first = mask("dropout", RandomStream())
    assert torch.equal(first, mask("dropout", RandomStream()))
    for other in (mask("dropout_1", RandomStream()), mask("dropout", RandomStream(step=1)),
                  mask("dropout", RandomStream(draw=1)), mask("dropout", RandomStream(seed=1))):
        assert 0.4 < (first != other).double().mean().item() < 0.6


def test_an_element_gets_the_same_value_whatever_box_draws_it() -> None:
    key, full = op_key("dropout"), [6, 10, 12]
    whole = random_box(full, [0, 0, 0], full, key)
    piece = random_box([3, 4, 5], [2, 6, 7], full, key)
    assert torch.equal(piece, whole[2:5, 6:10, 7:12])
    normal = random_box(full, [0, 0, 0], full, key, "normal")
    assert torch.equal(random_box([1, 10, 12], [5, 0, 0], full, key, "normal"), normal[5:6])


class Noisy(nn.Module):
    """Every random op capture rewrites, in place or not, on a fresh tensor too."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.dropout(self.linear(x), 0.2, training=True)
        y = y + torch.rand_like(y) + torch.randn(y.shape) + torch.empty_like(y).normal_(1.0, 2.0)
        y = y * y.new_empty(y.shape[0], 1).bernoulli_(0.7) + torch.bernoulli(torch.full_like(y, 0.5))
        return (y + torch.empty_like(y).uniform_(-1, 1)).sum()


def test_every_random_op_is_captured_plan_invariant() -> None:
    model, batch = Noisy(), torch.randn(8, 8)
    graph = lnn.trace(model, (batch,))
    aten = [op.target for op in graph.ops if op.target.startswith("aten.")]
    assert not [target for target in aten if any(word in target for word in ("dropout", "bernoulli", "rand", "normal", "uniform_"))]
    plan = lnn.parallelize(model, (batch,), "dp", 4)
    plan.verify()


def test_eval_mode_keeps_dropout_off() -> None:
    model, batch = dropout_gpt()
    model.eval()
    try:
        with torch.no_grad():
            assert torch.equal(model.compute_loss(batch), model.compute_loss(batch))
    finally:
        model.train()


def test_a_plan_that_draws_masks_tells_a_user_switching_from_ddp_and_one_without_says_nothing() -> None:
    from lightning_nnscaler.strategy.planning import random_masks_notice

    model, batch = dropout_gpt()
    notice = random_masks_notice(lnn.parallelize(model, batch, "dp", 2, step="training_step"))
    assert notice is not None and "strategy='ddp'" in notice and "dropout" in notice and "more" in notice
    torch.manual_seed(0)
    plain = GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=64, layers=1, heads=16))
    assert random_masks_notice(lnn.parallelize(plain, plain.example_batch(8, torch.Generator().manual_seed(0)), "dp", 2, step="training_step")) is None
