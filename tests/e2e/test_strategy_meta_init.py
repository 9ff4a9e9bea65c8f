"""A module built on the meta device: ``Trainer.init_module()`` under NnScalerStrategy records the initialization
and each rank materializes only its pieces (``lightning_nnscaler.init``), with the values the same seed gives eagerly.

2 gloo ranks, 10 optimizer steps of 2 accumulated batches with norm clipping, under dp, tp, zero3 and 1f1b, against
``ddp`` building the same module under ``init_module()`` (real weights): per-batch losses, validation and the final
weights (``strategy.full_state_dict()``) are equal at rtol 1e-5, and the module the user holds stays on meta.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from support.ranks import launch_ranks

from lightning_runs import parity_worker  # noqa: E402

OPTIONS = {"steps": 10, "accumulate": 2, "clip": 0.5, "init": "init_module"}
RECIPES = {"dp": "nnscaler", "tp": "nnscaler_tp", "zero3": "nnscaler_zero3", "1f1b": "nnscaler_1f1b"}


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    runs = [("ddp", "ddp", OPTIONS), *[(name, strategy, OPTIONS) for name, strategy in RECIPES.items()]]
    return launch_ranks(parity_worker, 2, runs, timeout=600)[0]


@pytest.mark.timeout(660)
@pytest.mark.parametrize("name", list(RECIPES))
def test_a_module_built_on_meta_trains_like_ddp_without_a_full_copy(results: dict[str, Any], name: str) -> None:
    ours, ddp = results[name], results["ddp"]
    assert ours["on_meta"] and not ddp["on_meta"]  # no rank ever filled the module: only the pieces were materialized
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(ddp["losses"]), rtol=1e-5, atol=0)
    assert ours["val_loss"] == pytest.approx(ddp["val_loss"], rel=1e-5)
    assert set(ours["state"]) == set(ddp["state"])
    for key, value in ddp["state"].items():
        torch.testing.assert_close(ours["state"][key], value, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.timeout(660)
def test_tensor_parallel_ranks_hold_only_their_pieces(results: dict[str, Any]) -> None:
    boxes = results["tp"]["boxes"]
    shapes = {key: value.shape for key, value in results["ddp"]["state"].items()}
    split = [key for key, held in boxes.items() if all(tuple(stop - start for start, stop in box) != tuple(shapes[key]) for box in held)]
    assert len(split) >= len(boxes) // 2, f"only {split} are split"
