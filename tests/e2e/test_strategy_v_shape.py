"""ZB-V and V-Half pipelines under the Trainer at 2 and 4 gloo ranks (a GPT of 8 blocks, 10 steps), against ddp.

Rank r of p holds model stages r and 2p - 1 - r (at 4 ranks one block per stage, embeddings with the first,
the head with the last); per-batch losses, the logged and validation losses and the final weights equal
ddp's at rtol 1e-5.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from support.ranks import launch_ranks

from lightning_runs import parity_worker  # noqa: E402

OPTIONS = {"steps": 10, "model": "gpt8"}
V_SHAPES = {"zbv": "nnscaler_zbv", "vhalf": "nnscaler_vhalf"}


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def results(request: pytest.FixtureRequest) -> dict[str, Any]:
    blocks = "2,2,2,2" if request.param == 2 else "1,1,1,1,1,1,1,1"
    strategies = {name: {"recipe": name, "layers_per_stage": blocks} for name in V_SHAPES}
    runs = [("ddp", "ddp", OPTIONS), *[(name, strategy, OPTIONS) for name, strategy in strategies.items()]]
    return launch_ranks(parity_worker, request.param, runs, timeout=400)[0]


@pytest.mark.timeout(500)
@pytest.mark.parametrize("name", list(V_SHAPES))
def test_v_shaped_pipelines_train_like_ddp(results: dict[str, Any], name: str) -> None:
    ours, ddp = results[name], results["ddp"]
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(ddp["losses"]), rtol=1e-5, atol=1e-6)
    assert ours["train_loss"] == pytest.approx(ddp["train_loss"], rel=1e-5)
    assert ours["val_loss"] == pytest.approx(ddp["val_loss"], rel=1e-5)
    for key, value in ddp["state"].items():
        torch.testing.assert_close(ours["state"][key], value, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{name} {k}: {m}")
