"""Per-rank memory of plans, measured on the tensors each rank really holds (GPT hidden 1024, 8 layers).

Model state = bytes of the parameters, gradients and AdamW state tensors a rank holds after an
optimizer step (for ZeRO-3: at rest, between steps). Activation peak = the largest number of
bytes autograd keeps saved for backward at once during the forward pass, counted with
``torch.autograd.graph.saved_tensors_hooks`` (distinct storages). Every rank runs as a thread
with in-memory communication, so the numbers are exact byte counts, not estimates.

Goals: tp=4 model state <= 0.28x single device; coshard(shards=4) activation peak <= 0.6x tp at
4 ranks; zero3 model state at 4 ranks <= 0.3x dp.

``--only rss``: what users see. Each configuration is a short Lightning fit in fresh processes
(``memory_ranks.py``; GPT of 134M parameters, 2.0 GiB of fp32 AdamW training state on one device), the
model built under ``trainer.init_module()`` (on meta under nnscaler). Per rank: peak resident memory above
the bare process, as a ratio to one device's, beside explain()'s and the simulator's (``cpu`` spec)
predictions. Every configuration runs with glibc's mmap threshold fixed (``FIXED_MMAP_THRESHOLD``). Goals at 4
ranks: zero3 <= 0.35, hybrid3d <= 0.35, 1f1b <= 0.40, tp <= 0.45, zero1 <= 0.60, dp about ddp.
Run: python benchmarks/memory.py [--only tensors|rss] [--configs tp=4,zero3=4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.codegen import module_from_source
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.runtime.executor import RankExecutor
from lightning_nnscaler.runtime.memory_comm import run_ranks


class SavedBytes:
    """Bytes autograd saves for backward during the forward pass (distinct storages, parameters
    excluded). Nothing saved in forward is freed before backward, so the total is the peak;
    tensors saved again while backward recomputes a checkpointed region are not counted."""

    def __init__(self, held: dict[str, torch.Tensor]) -> None:
        self.held = held
        self.parameter_storages: set[int] | None = None  # read at the first save: ZeRO-3 gathers first
        self.live: dict[int, int] = {}

    @property
    def peak(self) -> int:
        return sum(self.live.values())

    def pack(self, tensor: torch.Tensor) -> Any:
        if self.parameter_storages is None:
            self.parameter_storages = {held.untyped_storage().data_ptr() for held in self.held.values() if held.numel()}
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if torch._C._current_autograd_node() is None and key not in self.parameter_storages:
            self.live[key] = storage.nbytes()
        return tensor

    def unpack(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def tensor_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of distinct storages."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor is not None and tensor.numel():
            seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(seen.values())


def measure(model: GPT, batch: Any, recipe: str, world_size: int, **params: Any) -> list[dict[str, int]]:
    """Model state and activation peak of every rank after one training step."""
    plan = lnn.parallelize(model, batch, recipe, world_size, step="training_step", **params)
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    inputs = plan.inputs()

    def run(communicator: Any) -> dict[str, int]:
        module = module_from_source(plan.sources[communicator.rank], f"memory_rank{communicator.rank}")
        executor = RankExecutor(module, communicator.rank, state, plan.graph.constant_values, communicator)
        optimizer = torch.optim.AdamW(executor.parameters(), lr=1e-4)
        saved = SavedBytes(executor.held)
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            executor.forward_backward(inputs)
        optimizer.step()
        executor.after_optimizer_step()
        parameters = [shard.tensor for shard in executor.shards.values()] + executor.parameters()
        gradients = [parameter.grad for parameter in executor.parameters()]
        optimizer_state = [value for entry in optimizer.state.values() for value in entry.values() if isinstance(value, torch.Tensor) and value.dim()]
        return {
            "model_state": tensor_bytes(parameters) + tensor_bytes(gradients) + tensor_bytes(optimizer_state),
            "activation_peak": saved.peak,
        }

    return run_ranks(world_size, run, timeout=1200)


RSS_CONFIGS = {
    "one device": ("auto", 1, ""), "ddp=2": ("ddp", 2, ""), "ddp=4": ("ddp", 4, ""),
    **{f"{recipe}={devices}": (f"nnscaler_{recipe}" if recipe != "dp" else "nnscaler", devices, "")
       for devices in (2, 4) for recipe in ("dp", "zero1", "zero3", "tp", "1f1b")},
    "hybrid3d=2": ("nnscaler_hybrid3d", 2, "dp=1,tp=1,pp=2"), "hybrid3d=4": ("nnscaler_hybrid3d", 4, "dp=1,tp=2,pp=2"),
    # ZeRO-3 cut into one stage per layer: each rank gathers one layer's parameters at a time
    "zero3 stages=2": ("nnscaler_zero3", 2, "stages=8"), "zero3 stages=4": ("nnscaler_zero3", 4, "stages=8"),
}
RSS_GOALS = {"zero3=4": 0.35, "zero3 stages=4": 0.35, "hybrid3d=4": 0.35, "1f1b=4": 0.40, "tp=4": 0.45, "zero1=4": 0.60}


FIXED_MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
"""glibc's malloc raises its mmap threshold each time a large block is freed, so tensors allocated after the first
frees come from the heap, which keeps their pages after they are freed: the resident high-water mark then counts
every tensor that was ever alive, not the most alive at once. A fixed threshold (the variable also turns the
raising off) returns each freed tensor's pages, so the RSS peak measures what the allocator's peak does on a GPU.
Set for every configuration alike, one device and ddp included."""


def rss_run(strategy: str, devices: int, params: str = "") -> list[dict]:
    """Every rank's report of one configuration (``memory_ranks.py`` in a fresh process; Lightning launches the ranks)."""
    with tempfile.TemporaryDirectory() as out:
        script = Path(__file__).with_name("memory_ranks.py")
        completed = subprocess.run(
            [sys.executable, str(script), "--strategy", strategy, "--devices", str(devices), "--out", out, "--params", params], cwd=out,
            capture_output=True, text=True, timeout=1800, env={**os.environ, **FIXED_MMAP_THRESHOLD},
        )
        reports = sorted((json.loads(path.read_text()) for path in Path(out).glob("rank*.json")), key=lambda report: report["rank"])
    if completed.returncode != 0 or len(reports) != devices:
        return [{"failed": (completed.stderr.strip().splitlines() or ["no output"])[-1]}]
    return reports


def rss_table(names: list[str]) -> None:
    """Print the per-rank peak of each configuration as a ratio to one device's."""
    mib = 2**20
    single = rss_run(*RSS_CONFIGS["one device"])[0]["peak_above_bare"]
    print(f"peak resident memory per rank above the bare process; one device {single / mib:.0f} MiB")
    print(f"{'configuration':<14} {'worst rank MiB':>14} {'ratio':>7} {'goal':>6} {'explain() MiB':>14} {'/ measured':>11} "
          f"{'simulator MiB':>14} {'/ measured':>11}")
    for name in names:
        reports = rss_run(*RSS_CONFIGS[name]) if name != "one device" else [{"peak_above_bare": single}]
        if "failed" in reports[0]:
            print(f"{name:<14} failed: {reports[0]['failed']}")
            continue
        worst = max(reports, key=lambda report: report["peak_above_bare"])
        goal = f"{RSS_GOALS[name]:.2f}" if name in RSS_GOALS else ""
        predictions = ""
        for key in ("explain", "simulated"):
            predicted = reports[0][key][worst["rank"]] if key in reports[0] else None
            predictions += f" {predicted / mib:14.0f} {predicted / worst['peak_above_bare']:11.2f}" if predicted else f" {'':>14} {'':>11}"
        print(f"{name:<14} {worst['peak_above_bare'] / mib:14.0f} {worst['peak_above_bare'] / single:7.2f} {goal:>6}{predictions}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--only", choices=("tensors", "rss"), default=None)
    parser.add_argument("--configs", default=",".join(RSS_CONFIGS), help="--only rss: the configurations, comma-separated")
    arguments = parser.parse_args()
    if arguments.only != "tensors":
        rss_table([name.strip() for name in arguments.configs.split(",")])
    if arguments.only == "rss":
        return
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=1024, seq_len=arguments.seq, hidden=arguments.hidden, layers=arguments.layers, heads=16)
    model = GPT(config)
    batch = model.example_batch(arguments.batch)
    single = measure(model, batch, "dp", 1)[0]
    runs = {
        "tp=4": measure(model, batch, "tp", 4),
        "coshard(shards=4)": measure(model, batch, "coshard", 4, shards=4),
        "dp=4": measure(model, batch, "dp", 4),
        "zero3=4": measure(model, batch, "zero3", 4),
    }

    def worst(name: str, key: str) -> int:
        return max(rank[key] for rank in runs[name])

    mib = 1024 * 1024
    rows = [
        ("model state: tp=4 vs single device", worst("tp=4", "model_state"), single["model_state"], 0.28),
        ("activation peak: coshard vs tp (4 ranks)", worst("coshard(shards=4)", "activation_peak"), worst("tp=4", "activation_peak"), 0.6),
        ("model state: zero3 vs dp (4 ranks)", worst("zero3=4", "model_state"), worst("dp=4", "model_state"), 0.3),
    ]
    print(f"GPT hidden {config.hidden}, {config.layers} layers, seq {config.seq_len}, batch {arguments.batch}; per-rank maximum")
    print(f"{'comparison':<44} {'ours MiB':>10} {'peer MiB':>10} {'ratio':>7} {'goal':>6}")
    for label, ours, peer, goal in rows:
        print(f"{label:<44} {ours / mib:10.1f} {peer / mib:10.1f} {ours / peer:7.3f} {goal:6.2f}")


if __name__ == "__main__":
    main()
