"""coshard with recompute on models written as the Lightning/PyTorch docs write them, and on every reference model.

Each plan runs all 4 ranks' generated code in one process (``plan.verify()``), recomputes (its code
has checkpointed recompute functions) and splits (a rank holds a fraction of a linear's weight).
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_nnscaler as lnn
from lightning_nnscaler.models.evoformer import Evoformer, EvoformerConfig
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.models.mbart import MBart, MBartConfig
from lightning_nnscaler.models.swin import Swin, SwinConfig
from lightning_nnscaler.plans.catalog import RecipeError
from lightning_nnscaler.plans.coverage import parameter_coverage
from plans_support import MultiheadAttentionLM

WORLD_SIZE = 4


class DocsAutoencoder(nn.Module):
    """Lightning's docs autoencoder: two MLP stacks in a row, the second's split starting where the first's ends."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(28 * 28, 64), nn.ReLU(), nn.Linear(64, 3))
        self.decoder = nn.Sequential(nn.Linear(3, 64), nn.ReLU(), nn.Linear(64, 28 * 28))

    def training_step(self, batch: torch.Tensor, batch_idx: int = 0) -> torch.Tensor:
        x_hat = self.decoder(self.encoder(batch))
        return F.mse_loss(x_hat, batch)


def docs_autoencoder() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return DocsAutoencoder(), torch.rand(8, 28 * 28, generator=torch.Generator().manual_seed(1))


def multihead_attention_lm() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    return MultiheadAttentionLM(causal=False), (torch.randint(0, 64, (4, 8), generator=generator), torch.randint(0, 64, (4, 8), generator=generator))


def reference(model_class: type, config: object) -> tuple[nn.Module, object]:
    torch.manual_seed(0)
    model = model_class(config)
    return model, model.example_batch(2, torch.Generator().manual_seed(1))


# Heads that 4 ranks x 2 shards divide.
REFERENCE_MODELS = {
    "gpt": lambda: reference(GPT, GPTConfig(vocab_size=64, seq_len=16, hidden=32, layers=2, heads=8)),
    "swin": lambda: reference(Swin, dataclasses.replace(SwinConfig.small(), embed_dim=32, heads=(8, 8))),
    "mbart": lambda: reference(MBart, MBartConfig(vocab_size=64, seq_len=8, hidden=32, encoder_layers=1, decoder_layers=1, heads=8)),
    "evoformer": lambda: reference(Evoformer, dataclasses.replace(EvoformerConfig.small(), c_m=16, c_z=16, c_opm=8, msa_heads=8, pair_heads=8, blocks=1, recycles=1)),
}


def checkpoint_calls(source: str) -> int:
    """The recompute functions a rank's generated module calls through ``checkpoint``."""
    return len(re.findall(r"= checkpoint\(recompute_\d+(?:_\d+)?,", source))


def shares(plan: lnn.Plan) -> dict[str, float]:
    """Per parameter, the largest fraction of it that one rank holds."""
    return {parameter.key: parameter.largest_share / parameter.elements for parameter in parameter_coverage(plan.planned)}


def assert_coshards_with_recompute(plan: lnn.Plan, split_weights: list[str]) -> None:
    report = plan.verify()
    assert report.world_size == WORLD_SIZE and report.loss == pytest.approx(report.reference_loss, rel=1e-5)
    assert all(checkpoint_calls(source) > 0 for source in plan.sources)
    assert split_weights and all(shares(plan)[key] == pytest.approx(1 / WORLD_SIZE) for key in split_weights)


@pytest.mark.timeout(300)
def test_docs_autoencoder_coshards_both_mlp_stacks_with_recompute() -> None:
    model, batch = docs_autoencoder()
    plan = lnn.parallelize(model, batch, "coshard", WORLD_SIZE, step="training_step", shards=2)
    assert_coshards_with_recompute(plan, ["encoder.0.weight", "encoder.2.weight", "decoder.0.weight", "decoder.2.weight"])
    assert checkpoint_calls(plan.sources[0]) == 4  # 2 shards x 2 MLP stacks: one group each, not one spanning both


@pytest.mark.timeout(300)
def test_multihead_attention_lm_coshards_its_heads_and_mlps_with_recompute() -> None:
    model, batch = multihead_attention_lm()
    plan = lnn.parallelize(model, batch, "coshard", WORLD_SIZE, step="training_step", shards=2)
    assert_coshards_with_recompute(plan, ["blocks.0.attn.in_proj_weight", "blocks.1.attn.out_proj.weight", "blocks.0.mlp.0.weight", "blocks.1.mlp.2.weight"])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", sorted(REFERENCE_MODELS))
def test_reference_models_coshard_with_recompute(name: str) -> None:
    model, batch = REFERENCE_MODELS[name]()
    plan = lnn.parallelize(model, batch, "coshard", WORLD_SIZE, step="training_step", shards=2)
    assert_coshards_with_recompute(plan, [key for key, share in shares(plan).items() if key.endswith("weight") and share < 1])


def test_the_recipe_constraints_hint_is_only_for_errors_it_can_fix() -> None:
    from lightning_nnscaler.capture import CaptureError
    from lightning_nnscaler.codegen import CodegenError
    from lightning_nnscaler.ir.validate import IdleRankError
    from lightning_nnscaler.strategy.planning import breaks_recipe_constraints

    assert breaks_recipe_constraints(RecipeError("parts do not divide the heads"))
    assert breaks_recipe_constraints(IdleRankError("rank 3 runs no op"))
    assert breaks_recipe_constraints(ValueError("coshard: shards must be a positive int"))
    assert not breaks_recipe_constraints(CodegenError("the program cannot be written as code"))
    assert not breaks_recipe_constraints(CaptureError("cannot capture"))
    assert not breaks_recipe_constraints(RuntimeError("internal"))
