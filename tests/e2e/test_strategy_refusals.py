"""Under the Trainer, bad input is refused as ddp refuses it and before any rank waits in a collective:
a collective timeout of 0 when the strategy is built, a recipe count of 0 when the strategy is built,
and a ragged last batch (``drop_last=False``) that the recipe's microbatches cannot split, at the step
that loads it, naming the rows, the microbatches and the fixes (every rank plans that batch alike, so
every rank raises the same error)."""

from __future__ import annotations

import pytest
import torch

from lightning_nnscaler import NnScalerStrategy
from lightning_nnscaler.plans.catalog import RecipeError

import lightning as L  # noqa: E402 - after lightning_nnscaler
from lightning.pytorch.utilities.exceptions import MisconfigurationException  # noqa: E402

from lightning_runs import ScheduledGPT, TokenDataset  # noqa: E402 - tests/e2e is on sys.path


def _trainer(strategy: NnScalerStrategy, max_steps: int = -1) -> L.Trainer:
    return L.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_epochs=1, max_steps=max_steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )


@pytest.mark.parametrize("timeout", [0, -1.0])
def test_a_timeout_of_zero_or_below_is_refused_when_the_strategy_is_built(timeout: float) -> None:
    with pytest.raises(ValueError, match=rf"NnScalerStrategy\(timeout={timeout}\): give the seconds a collective may wait.*a finite number > 0"):
        _trainer(NnScalerStrategy(timeout=timeout))
    assert _trainer(NnScalerStrategy(timeout=0.5)).strategy.timeout == 0.5


def test_zero_microbatches_are_refused_when_the_strategy_is_built() -> None:
    with pytest.raises(RecipeError, match=r"recipe '1f1b': parameter 'microbatches' is 0; it must be int >= 1, or None for its default"):
        _trainer(NnScalerStrategy(recipe="1f1b", microbatches=0))


def _fit(drop_last: bool) -> L.Trainer:
    """1f1b with 2 microbatches over batches of 2 of 5 samples: the last batch has 1 row unless dropped."""
    from lightning_nnscaler.models.gpt import GPTConfig

    torch.manual_seed(0)
    trainer = _trainer(NnScalerStrategy(recipe="1f1b", microbatches=2))
    train = torch.utils.data.DataLoader(TokenDataset(5, seed=1), batch_size=2, drop_last=drop_last)
    trainer.fit(ScheduledGPT(GPTConfig.small()), train)
    return trainer


@pytest.mark.timeout(180)
def test_a_ragged_last_batch_the_microbatches_cannot_split_is_refused_naming_the_fix(one_rank_group: None) -> None:
    with pytest.raises(
        MisconfigurationException,
        match=r"1f1b: microbatches \(2\) must divide each replica's batch \(1 row\): one of \[1\]\. Use a larger batch_size.*"
        r"fewer microbatches \(or None, which picks one for each batch\), or DataLoader\(drop_last=True\) if only the last batch is smaller",
    ):
        _fit(drop_last=False)


@pytest.mark.timeout(180)
def test_the_same_run_trains_with_drop_last(one_rank_group: None) -> None:
    assert _fit(drop_last=True).global_step == 2
