"""A loss averaged over the targets it keeps (``ignore_index``) is the global batch's mean under every plan, as
one device computes it; where several data-parallel replicas keep different numbers of targets that differs
from ddp's average of the replicas' means, and ``parallelize`` says so (``GlobalMeanWarning``), as the strategy
does at a plan's first step, on the batches the replicas loaded (``KeptTargetsCheck``)."""

from __future__ import annotations

import threading
import warnings
from typing import Any, Callable

import pytest
import torch
from torch import nn

import lightning_nnscaler as lnn
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.strategy.planning import KeptTargetsCheck


def gpt_with_ignored_targets(first_rows: int = 2) -> tuple[GPT, tuple[torch.Tensor, torch.Tensor]]:
    """The small GPT and a batch of 8 rows whose ``first_rows`` ignore their targets after position 5."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.small())
    tokens, targets = model.example_batch(8, torch.Generator().manual_seed(0))
    targets = targets.clone()
    targets[:first_rows, 5:] = -100  # with 2: the first replica keeps fewer targets than the others
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


@pytest.mark.parametrize("ignored_rows", [0, 8])
def test_replicas_that_keep_as_many_targets_do_not_warn(ignored_rows: int) -> None:
    """A plain cross_entropy (no target ignored), or every replica ignoring as many: ddp's mean is the global one."""
    model, batch = gpt_with_ignored_targets(ignored_rows)
    assert global_mean_warnings(model, batch, "dp", 2) == []


def strategy_warnings(plan: lnn.Plan, steps: int) -> list[str]:
    """``KeptTargetsCheck`` on the 2 ranks of ``plan`` (threads, each its replica's rows of the plan's example batch,
    gathering each other's counts) for ``steps`` steps; the messages of the warnings it gave."""
    whole = plan.inputs()
    arrived: list[Any] = [None, None]
    barrier = threading.Barrier(2, timeout=30)

    def gather_for(rank: int) -> Callable[[Any], list[Any]]:
        def gather(value: Any) -> list[Any]:
            arrived[rank] = value
            barrier.wait()
            both = list(arrived)
            barrier.wait()
            return both
        return gather

    def run_rank(rank: int) -> None:
        check, inputs = KeptTargetsCheck(), plan.replica_inputs(rank, whole)
        for _ in range(steps):
            check(plan, inputs, rank, gather_for(rank))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ranks = [threading.Thread(target=run_rank, args=(rank,)) for rank in range(2)]
        for thread in ranks:
            thread.start()
        for thread in ranks:
            thread.join()
    return [str(warning.message) for warning in caught if issubclass(warning.category, lnn.GlobalMeanWarning)]


def test_the_strategy_warns_once_when_the_loaded_replicas_keep_different_counts() -> None:
    model, batch = gpt_with_ignored_targets()
    # The strategy plans on every replica's rows alike (whole_batch): planning sees equal counts and says nothing.
    with warnings.catch_warnings():
        warnings.simplefilter("error", lnn.GlobalMeanWarning)
        plan = lnn.parallelize(model, (batch[0][:4].repeat(2, 1), batch[1][:4].repeat(2, 1)), "dp", 2, step="training_step")
    plan.example_args = batch  # the rows the replicas really load: the first keeps fewer targets
    messages = strategy_warnings(plan, steps=3)
    assert len(messages) == 1
    assert messages[0].startswith("cross_entropy_loss: ") and "global batch of 2 data-parallel replicas" in messages[0]
    assert "(cross_entropy_loss keeps 42 to 64 targets per replica)" in messages[0]  # 4 rows of 16, 2 of them 11 ignored


def test_the_strategy_does_not_warn_for_a_plain_cross_entropy() -> None:
    model, batch = gpt_with_ignored_targets(0)
    assert strategy_warnings(lnn.parallelize(model, batch, "dp", 2, step="training_step"), steps=2) == []


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
