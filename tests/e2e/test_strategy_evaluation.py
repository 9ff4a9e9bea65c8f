"""Evaluation through the plan: ``validation_step`` and ``test_step`` planned forward-only over the training
pieces under tp, zero3 and 1f1b at 2 gloo ranks, against ``ddp`` and the eager module.

Before training (the sanity check) the evaluation plan runs over the module's tensors; during the fit it
shares the training plan's pieces; ``validate`` from a checkpoint plans anew in a new Trainer. A
validation step that returns more than a number runs on the full module, and says so.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from support.ranks import launch_ranks

from evaluation_runs import MODELS, evaluation_worker  # noqa: E402
from feature_runs import loaders  # noqa: E402
from lightning_nnscaler.models.gpt import GPTConfig  # noqa: E402
from lightning_runs import GLOBAL_BATCH  # noqa: E402

RUNS = [
    ("ddp", "ddp", "value"), ("tp", "nnscaler_tp", "value"), ("zero3", "nnscaler_zero3", "value"), ("1f1b", "nnscaler_1f1b", "value"),
    ("tp-logging-only", "nnscaler_tp", "none"), ("ddp-dict", "ddp", "dict"), ("tp-dict", "nnscaler_tp", "dict"),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Rank 0's results of every run."""
    return launch_ranks(evaluation_worker, 2, RUNS, str(tmp_path_factory.mktemp("evaluation")), timeout=600)[0]


def eager_loss(state: dict[str, torch.Tensor], loader: str) -> float:
    """The mean loss of the trained weights over a loader's batches, evaluated eagerly on one device."""
    model = MODELS["value"](GPTConfig.small())
    model.load_state_dict(state)
    with torch.no_grad():
        return float(torch.stack([model.compute_loss(batch) for batch in loaders(GLOBAL_BATCH)[loader]]).mean())


@pytest.mark.timeout(660)
@pytest.mark.parametrize("name", ["tp", "zero3", "1f1b", "tp-logging-only"])
def test_evaluation_steps_run_through_the_plan_with_ddps_results(results: dict[str, Any], name: str) -> None:
    ours, ddp = results[name], results["ddp"]
    assert ours["evaluated_by"] == {"validation_step": "plan", "test_step": "plan"}
    torch.testing.assert_close(torch.tensor(ours["fit_losses"]), torch.tensor(ddp["fit_losses"]), rtol=1e-5, atol=0)
    assert len(ours["fit_losses"]) == 4  # the sanity check (before training planned), one per epoch, then validate()
    for loop in ("validate", "test", "validate_checkpoint"):
        assert ours[loop] == pytest.approx(ddp[loop], rel=1e-5), loop
    assert ours["validate"] == pytest.approx(eager_loss(ours["state"], "val"), rel=1e-5)
    assert ours["test"] == pytest.approx(eager_loss(ours["state"], "test"), rel=1e-5)
    assert ours["validate_checkpoint"] == pytest.approx(ours["validate"], rel=1e-5)


@pytest.mark.timeout(660)
def test_a_step_the_plan_cannot_return_runs_on_the_full_module(results: dict[str, Any]) -> None:
    ours, ddp = results["tp-dict"], results["ddp-dict"]
    assert ours["evaluated_by"] == {"validation_step": "module", "test_step": "plan"}
    torch.testing.assert_close(torch.tensor(ours["fit_losses"]), torch.tensor(ddp["fit_losses"]), rtol=1e-5, atol=0)
    assert ours["validate"] == pytest.approx(ddp["validate"], rel=1e-5)
