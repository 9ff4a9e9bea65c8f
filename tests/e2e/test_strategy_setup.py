"""NnScalerStrategy: registered names, and bad input refused before training starts (in one process,
and at 2 ranks for recipes that do not fit the devices or the model's heads).

The one-device runs join a 1-rank gloo group in the pytest process; the fixture leaves it and
restores the environment variables Lightning's launcher set.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import lightning_nnscaler as lnn
from lightning_nnscaler import NnScalerStrategy
from lightning_nnscaler.plans.catalog import RecipeError
from support.ranks import launch_ranks

import lightning as L  # noqa: E402 - after lightning_nnscaler
from lightning.pytorch.strategies import StrategyRegistry  # noqa: E402
from lightning.pytorch.utilities.exceptions import MisconfigurationException  # noqa: E402

from feature_runs import setup_error_worker  # noqa: E402
from lightning_runs import GLOBAL_BATCH, ScheduledGPT, TokenDataset, fit_gpt, single_device_run  # noqa: E402


def test_every_catalog_recipe_has_a_registered_name() -> None:
    expected = {"nnscaler", "nnscaler_spawn"} | {f"nnscaler_{spec.name}" for spec in lnn.list_recipes()}
    assert expected <= set(StrategyRegistry.available_strategies())
    assert StrategyRegistry.get("nnscaler").recipe == "dp"
    trainer = L.Trainer(strategy="nnscaler_tp", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, NnScalerStrategy)
    assert trainer.strategy.recipe == "tp"
    assert trainer.strategy.world_size == 2
    # Every rank loads the whole global batch; the generated code slices each rank's share.
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"recipe": "megatron"}, r"unknown recipe 'megatron'.*catalog.*has: 1f1b, 3f1b, auto, coshard, dp"),
        ({"recipe": "tp", "degree": "2"}, r"parameter 'degree' expects int, got str.*NnScalerStrategy\(recipe='tp', degree=<int>\)"),
        ({"recipe": "dp", "shards": 2}, r"unknown parameter 'shards'"),
        ({"recipe": "hybrid", "dp": 2}, r"parameter 'tp' \(int\) is required"),
    ],
)
def test_bad_recipe_or_parameter_raises_at_construction(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(RecipeError, match=message):
        NnScalerStrategy(**arguments)


@pytest.mark.timeout(120)
def test_one_device_trains_like_eager(one_rank_group: None) -> None:
    expected_losses, expected_state = single_device_run()
    result = fit_gpt(NnScalerStrategy(recipe="dp"), devices=1)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected_losses), rtol=1e-5, atol=1e-6)
    assert result["train_loss"] == pytest.approx(expected_losses[-1], rel=1e-5)  # self.log(sync_dist=True) replayed
    for key, value in expected_state.items():
        torch.testing.assert_close(result["state"][key], value, rtol=1e-5, atol=1e-5)


class Untraceable(ScheduledGPT):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.compute_loss(batch)
        if loss > 100:  # Python control flow on a tensor value cannot be captured
            loss = loss / 2
        return loss


class ComparesAnItem(ScheduledGPT):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.compute_loss(batch)
        if loss.item() > 100:  # the number would be the traced step's
            loss = loss / 2
        return loss


class ManualOptimization(ScheduledGPT):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False


class LogsAccuracy(ScheduledGPT):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.compute_loss(batch)
        self.log("train_accuracy", (self(batch[0]).argmax(-1) == batch[1]).float().mean())
        return loss


def _fit_one_device(model: L.LightningModule, samples: int = GLOBAL_BATCH * 2, drop_last: bool = True) -> L.Trainer:
    train = torch.utils.data.DataLoader(TokenDataset(samples, seed=1), batch_size=GLOBAL_BATCH, drop_last=drop_last)
    trainer = L.Trainer(
        strategy=NnScalerStrategy(), accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, train)
    return trainer


def _config() -> Any:
    from lightning_nnscaler.models.gpt import GPTConfig

    return GPTConfig.small()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("model_class", "samples", "drop_last", "message"),
    [
        (Untraceable, GLOBAL_BATCH * 2, True, r"could not plan Untraceable.training_step with recipe 'dp'.*cannot capture"),
        (ComparesAnItem, GLOBAL_BATCH * 2, True, r"training_step calls .item\(\) at .*test_strategy_setup.py:\d+ and compares \(gt\) its result"),
        (ManualOptimization, GLOBAL_BATCH * 2, True, r"manual optimization is not supported: remove `self.automatic_optimization = False`"),
    ],
)
def test_what_cannot_run_raises_naming_the_fix(one_rank_group: None, model_class: type, samples: int, drop_last: bool, message: str) -> None:
    model = model_class(_config())
    with pytest.raises(MisconfigurationException, match=message):
        _fit_one_device(model, samples, drop_last)


@pytest.mark.timeout(120)
def test_logged_values_other_than_the_loss_are_computed_by_the_plan(one_rank_group: None) -> None:
    torch.manual_seed(0)
    trainer = _fit_one_device(LogsAccuracy(_config()))
    torch.manual_seed(0)
    model = LogsAccuracy(_config())
    train = torch.utils.data.DataLoader(TokenDataset(GLOBAL_BATCH * 2, seed=1), batch_size=GLOBAL_BATCH, drop_last=True)
    eager = L.Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    eager.fit(model, train)
    expected = float(eager.callback_metrics["train_accuracy"])
    assert float(trainer.callback_metrics["train_accuracy"]) == pytest.approx(expected, rel=1e-5)


@pytest.mark.timeout(240)
def test_recipes_that_do_not_fit_the_devices_or_the_heads_raise_at_setup() -> None:
    cases = [
        ({"recipe": "tp", "degree": 4}, {}),  # more devices than the Trainer has
        ({"recipe": "hybrid", "dp": 1, "tp": 1}, {}),  # a grid smaller than the devices
        ({"recipe": "tp"}, {"heads": 1}),  # 2 pieces of 1 head
        ({"recipe": "coshard"}, {}),  # the default 4 shards x 2 devices = 8 pieces of 4 heads
        ({"recipe": "coshard", "allow_partial": True}, {}),  # asked for: attention whole, a warning says how much was split
    ]
    outcomes = launch_ranks(setup_error_worker, 2, cases, timeout=220)
    expected = [
        r"NnScalerStrategy\(recipe='tp', degree=4\) does not fit the Trainer's 2 devices.*degree \(4\) must be a positive "
        r"divisor of world_size \(2\).*Pass degree to fit 2 devices, or change the Trainer's devices / num_nodes",
        r"NnScalerStrategy\(recipe='hybrid', dp=1, tp=1\) does not fit the Trainer's 2 devices.*dp \(1\) × tp \(1\) = 1 must "
        r"equal world_size \(2\).*Pass dp, tp to fit 2 devices",
        r"NnScalerStrategy\(recipe='tp'\) cuts attention heads into 2 pieces \(degree=None: all 2 devices\), but "
        r"ScheduledGPT.blocks.0.attn has 1 heads, which 2 does not divide",
        r"NnScalerStrategy\(recipe='coshard'\) cuts attention heads into 8 pieces \(shards=4 × 2 devices\), but "
        r"ScheduledGPT.blocks.0.attn has 4 heads",
    ]
    for rank_outcomes in outcomes:
        for outcome, message in zip(rank_outcomes, expected):
            assert outcome["message"] is not None and re.search(message, outcome["message"], re.DOTALL), outcome["message"]
            assert outcome["global_step"] == 0 and not outcome["planned"]  # raised at setup: nothing planned or trained
        best_effort = rank_outcomes[len(expected)]
        assert best_effort["message"] is None and best_effort["global_step"] == 2 and best_effort["planned"]
        assert len(best_effort["partial"]) == 1 and re.search(
            r"recipe 'coshard' over 2 ranks split \d+% of the parameter elements.*4 heads, which 8 parts do not divide", best_effort["partial"][0], re.DOTALL
        ), best_effort["partial"]
