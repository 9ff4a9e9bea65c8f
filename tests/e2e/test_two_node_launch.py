"""Two "nodes" on this machine: two script processes, each ``Trainer(strategy="nnscaler", devices=1,
num_nodes=2)``, told their node and the rendezvous by the environment Lightning's ``LightningEnvironment``
reads (``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``), train like one device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_nnscaler.launch import free_port

from lightning_runs import single_device_run  # noqa: E402 - after lightning_nnscaler
from process_groups import kill_group

SCRIPT = Path(__file__).with_name("strategy_scripts.py")


@pytest.mark.timeout(300)
def test_two_nodes_of_one_device_train_like_one_device(tmp_path: Path) -> None:
    environment = {key: value for key, value in os.environ.items() if key not in ("LOCAL_RANK", "RANK", "GROUP_RANK")}
    environment.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    nodes = []
    try:
        for node in (0, 1):
            with open(tmp_path / f"node{node}.log", "w") as output:
                nodes.append(subprocess.Popen(
                    [sys.executable, str(SCRIPT), "two_node", str(tmp_path)], env={**environment, "NODE_RANK": str(node)},
                    cwd=tmp_path, stdout=output, stderr=subprocess.STDOUT, start_new_session=True,
                ))
        return_codes = [node.wait(timeout=270) for node in nodes]
    finally:
        for node in nodes:
            kill_group(node.pid)
    logs = "\n".join((tmp_path / f"node{node}.log").read_text()[-2000:] for node in (0, 1))
    assert return_codes == [0, 0], logs
    reports = [json.loads((tmp_path / f"node{node}.json").read_text()) for node in (0, 1)]
    assert [(report["global_rank"], report["world_size"]) for report in reports] == [(0, 2), (1, 2)]
    expected_losses, _ = single_device_run()
    for report in reports:
        torch.testing.assert_close(torch.tensor(report["losses"]), torch.tensor(expected_losses), rtol=1e-5, atol=1e-6)
        assert report["train_loss"] == pytest.approx(expected_losses[-1], rel=1e-5)
