"""A loss averaged over the targets it keeps (``ignore_index``) is the global batch's mean under every plan, as
one device computes it; with several data-parallel replicas that differs from ddp's average of the replicas'
means, and ``parallelize`` says so (``GlobalMeanWarning``)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import lightning_nnscaler as lnn
from lightning_nnscaler.models.gpt import GPT, GPTConfig


def gpt_with_ignored_targets() -> tuple[GPT, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT(GPTConfig.small())
    tokens, targets = model.example_batch(8, torch.Generator().manual_seed(0))
    targets = targets.clone()
    targets[:2, 5:] = -100  # the first replica keeps fewer targets than the others
    return model, (tokens, targets)


def global_mean_warnings(model: nn.Module, batch: object, recipe: str, world_size: int, **params: object) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = lnn.parallelize(model, batch, recipe, world_size, step="training_step", **params)
    plan.verify()  # the global batch's loss and gradients, as one device computes them
    return [str(warning.message) for warning in caught if issubclass(warning.category, lnn.GlobalMeanWarning)]


@pytest.mark.parametrize(("recipe", "world_size", "params", "replicas"), [
    ("dp", 2, {}, 2), ("zero3", 2, {}, 2), ("1f1b", 4, {"stages": 2, "microbatches": 2}, 2), ("auto", 2, {"recipes": "tp"}, 2),
])
def test_a_mean_over_kept_targets_across_replicas_warns_naming_the_loss(recipe: str, world_size: int, params: dict, replicas: int) -> None:
    model, batch = gpt_with_ignored_targets()
    messages = global_mean_warnings(model, batch, recipe, world_size, **params)
    assert len(messages) == 1
    assert messages[0].startswith("cross_entropy_loss: ") and f"global batch of {replicas} data-parallel replicas" in messages[0]


@pytest.mark.parametrize(("recipe", "params"), [("tp", {}), ("gpipe", {"microbatches": 2})])
def test_one_replica_does_not_warn(recipe: str, params: dict) -> None:
    model, batch = gpt_with_ignored_targets()
    assert global_mean_warnings(model, batch, recipe, 2, **params) == []


def test_a_mean_over_a_fixed_count_does_not_warn() -> None:
    class Regression(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 1)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int = 0) -> torch.Tensor:
            inputs, targets = batch
            return nn.functional.mse_loss(self.linear(inputs), targets)

    batch = (torch.randn(8, 8, generator=torch.Generator().manual_seed(0)), torch.randn(8, 1, generator=torch.Generator().manual_seed(1)))
    assert global_mean_warnings(Regression(), batch, "dp", 2) == []
