"""``trainer.predict`` through the plan: ``predict_step`` planned forward-only over the training pieces under tp, zero3
and 1f1b at 2 gloo ranks, after a fit and from a checkpoint in a new Trainer, on an eager module and on one built on
meta, each rank's predictions (its own batches', as under ddp) equal to the eager module's on the same rows.

A prediction the plan cannot return (a dict with a string) runs on the full module with a warning, and is refused
on a module built on meta, naming why and the fix.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from support.ranks import launch_ranks

from feature_runs import TEST_SAMPLES  # noqa: E402
from lightning_nnscaler.models.gpt import GPTConfig  # noqa: E402
from predict_runs import MODELS, predict_worker  # noqa: E402

RECIPES = {"tp": TEST_SAMPLES, "zero3": TEST_SAMPLES // 2, "1f1b": TEST_SAMPLES}
"""Rows each rank predicts: every test sample, or under zero3 (2 data-parallel replicas) its replica's half."""
RUNS = [
    *[(f"{recipe}{suffix}", f"nnscaler_{recipe}", "logits", init) for recipe in RECIPES
      for suffix, init in (("", "eager"), ("-meta", "meta"))],
    ("tp-labelled", "nnscaler_tp", "labelled", "eager"), ("tp-labelled-meta", "nnscaler_tp", "labelled", "meta"),
    ("ddp", "ddp", "logits", "eager"),
]
ROWS = {name: RECIPES[name.removesuffix("-meta")] for name, strategy, kind, _ in RUNS if kind == "logits" and strategy != "ddp"}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every rank's results of every run."""
    return launch_ranks(predict_worker, 2, RUNS, str(tmp_path_factory.mktemp("predict")), timeout=600)


def eager_logits(state: dict[str, torch.Tensor], tokens: list[torch.Tensor]) -> list[torch.Tensor]:
    """The logits of the trained weights on each batch of ``tokens``, computed eagerly on one device."""
    model = MODELS["logits"](GPTConfig.small())
    model.load_state_dict(state)
    with torch.no_grad():
        return [model(batch) for batch in tokens]


@pytest.mark.timeout(660)
@pytest.mark.parametrize("name", list(ROWS))
def test_predict_runs_through_the_plan_and_gives_each_rank_its_own_rows(results: list[dict[str, Any]], name: str) -> None:
    state = results[0][name]["state"]
    assert results[0][name]["predicted_by"] == {"predict_step": "plan"}
    seen = []
    for rank, by_run in enumerate(results):
        ours = by_run[name]
        assert sum(len(batch) for batch in ours["tokens"]) == ROWS[name], f"rank {rank}"
        seen.extend(row for batch in ours["tokens"] for row in batch)
        for loop in ("predictions", "checkpoint_predictions"):
            expected = eager_logits(state, ours["tokens"])
            assert len(ours[loop]) == len(expected)
            for predicted, logits in zip(ours[loop], expected):
                torch.testing.assert_close(predicted, logits, rtol=1e-5, atol=1e-5, msg=lambda m: f"rank {rank} {loop}: {m}")
    assert len({tuple(row.tolist()) for row in seen}) == TEST_SAMPLES  # zero3's ranks predicted the two halves
    assert results[0][name]["on_meta"] == name.endswith("meta")  # predicting never filled the module built on meta


@pytest.mark.timeout(660)
def test_zero3_ranks_predict_what_ddp_ranks_predict(results: list[dict[str, Any]]) -> None:
    for rank, by_run in enumerate(results):  # ddp's sampler and zero3's give a rank the same rows
        ours, ddp = by_run["zero3"], by_run["ddp"]
        assert [tokens.tolist() for tokens in ours["tokens"]] == [tokens.tolist() for tokens in ddp["tokens"]], f"rank {rank}"
        torch.testing.assert_close(ours["predictions"], ddp["predictions"], rtol=1e-5, atol=1e-5, msg=lambda m: f"rank {rank}: {m}")


@pytest.mark.timeout(660)
def test_a_prediction_the_plan_cannot_return_runs_on_the_full_module_or_is_refused_on_meta(results: list[dict[str, Any]]) -> None:
    eager, meta = results[0]["tp-labelled"], results[0]["tp-labelled-meta"]
    assert eager["predicted_by"] == {"predict_step": "module"}
    assert any("runs LabelledGPT.predict_step on the full LightningModule" in warning for warning in eager["warnings"])
    expected = eager_logits(eager["state"], eager["tokens"])
    for predicted, logits in zip(eager["predictions"], expected):
        assert predicted["label"] == "gpt"
        torch.testing.assert_close(predicted["logits"], logits, rtol=1e-5, atol=1e-5)
    assert "predict_step must run on the whole module" in meta["error"] and "returns str" in meta["error"]
    assert "full_state_dict" in meta["error"]
