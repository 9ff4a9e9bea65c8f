"""Per-rank memory of plans, measured on the tensors each rank really holds (GPT hidden 1024, 8 layers).

Model state = bytes of the parameters, gradients and AdamW state tensors a rank holds after an
optimizer step (for ZeRO-3: at rest, between steps). Activation peak = the largest number of
bytes autograd keeps saved for backward at once during the forward pass, counted with
``torch.autograd.graph.saved_tensors_hooks`` (distinct storages). Every rank runs as a thread
with in-memory communication, so the numbers are exact byte counts, not estimates.

Goals: tp=4 model state <= 0.28x single device; coshard(shards=4) activation peak <= 0.6x tp at
4 ranks; zero3 model state at 4 ranks <= 0.3x dp.
Run: python benchmarks/memory.py
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    arguments = parser.parse_args()
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
