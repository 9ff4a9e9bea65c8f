"""Per-rank entry points for the multi-process tests (module-level so spawned processes import them)."""

from __future__ import annotations

from typing import Any

import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.codegen import module_from_source
from lightning_nnscaler.runtime import TorchDistributedCommunicator
from lightning_nnscaler.runtime.executor import RankExecutor

STEPS = 10
LEARNING_RATE = 1e-3


def build_model(name: str) -> tuple[torch.nn.Module, int]:
    """A reference model (same seed, same weights on every rank) and its batch size."""
    from lightning_nnscaler.models.gpt import GPT, GPTConfig
    from lightning_nnscaler.models.swin import Swin, SwinConfig

    torch.manual_seed(0)
    if name == "gpt":
        return GPT(GPTConfig.small()), 4
    if name == "swin":
        return Swin(SwinConfig.small()), 4
    if name == "mbart":
        from lightning_nnscaler.models.mbart import MBart, MBartConfig

        return MBart(MBartConfig.small()), 4
    if name == "evoformer":  # with recycling: two passes under no_grad, then the gradient pass
        from dataclasses import replace

        from lightning_nnscaler.models.evoformer import Evoformer, EvoformerConfig

        return Evoformer(replace(EvoformerConfig.small(), recycles=3)), 4
    raise ValueError(f"unknown model {name!r}")


def batches(model: Any, batch_size: int, steps: int = STEPS) -> list[Any]:
    """Deterministic batches, one per step."""
    return [model.example_batch(batch_size, torch.Generator().manual_seed(step)) for step in range(steps)]


def single_device_run(model_name: str, steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Eager training with AdamW: per-step losses and the final parameters."""
    model, batch_size = build_model(model_name)
    model.log = lambda *args, **kwargs: None
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    losses = []
    for batch in batches(model, batch_size, steps):
        optimizer.zero_grad()
        loss = model.training_step(batch, 0)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {key: value.detach().clone() for key, value in model.named_parameters()}


def plan_recipes(model_name: str, world_size: int, recipes: list[tuple[str, str, dict]]) -> list[tuple[str, list[str], dict[str, torch.Tensor], list[str]]]:
    """Plan each recipe once (in the test process): (label, per-rank sources, constants, batch input names)."""
    planned = []
    for label, recipe, params in recipes:
        model, batch_size = build_model(model_name)
        plan = lnn.parallelize(model, batches(model, batch_size, 1)[0], recipe, world_size, step="training_step", **params)
        planned.append((label, plan.sources, plan.graph.constant_values, [tensor.name for tensor in plan.graph.user_inputs]))
    return planned


def train_planned(rank: int, world_size: int, model_name: str, planned: list[tuple[str, list[str], dict, list[str]]], steps: int = STEPS) -> dict[str, Any]:
    """Train ``steps`` AdamW steps of each plan made by ``plan_recipes`` on real processes (each rank
    runs its generated code); per label, the losses and this rank's final parameter shards."""
    torch.set_num_threads(1)
    results = {}
    for label, sources, constants, input_names in planned:
        model, batch_size = build_model(model_name)
        state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        executor = RankExecutor(module_from_source(sources[rank], f"rank{rank}"), rank, state, constants, TorchDistributedCommunicator(timeout=60))
        optimizer = torch.optim.AdamW(executor.parameters(), lr=LEARNING_RATE)
        losses = []
        for batch in batches(model, batch_size, steps):
            optimizer.zero_grad()
            inputs = dict(zip(input_names, lnn.flatten_inputs(batch, step="training_step")))
            losses.append(float(executor.forward_backward(inputs)))
            optimizer.step()
            executor.after_optimizer_step()
        parameter_keys = {key for key, _ in model.named_parameters()}
        shards = [(shard.location, shard.tensor) for shard in executor.full_shards().values() if shard.location.state_key in parameter_keys]
        results[label] = {"losses": losses, "shards": shards}
    return results


def train_planned_models(rank: int, world_size: int, planned_by_model: list[tuple[str, list[tuple[str, list[str], dict, list[str]]]]]) -> dict[str, dict[str, Any]]:
    """`train_planned` for each ``(model name, plans)`` in turn, in one process group (one launch for
    several models); per model name, what `train_planned` returns."""
    return {model_name: train_planned(rank, world_size, model_name, planned) for model_name, planned in planned_by_model}


def assert_trains_like_one_device(
    per_rank: list[dict[str, Any]], label: str, expected_losses: list[float], expected_parameters: dict[str, torch.Tensor],
    loose: dict[str, float] | None = None,
) -> None:
    """Every rank's per-step losses (rtol 1e-5) and the merged final parameters (atol 1e-5, or ``loose[suffix]``
    for a parameter whose key ends so) of run ``label`` equal single-device training's.

    atol 1e-5: a parameter whose true gradient is exactly zero (a key projection's bias: softmax ignores
    a shift) gets AdamW-normalized rounding noise as updates, of order lr * 1e-3.
    """
    from lightning_nnscaler.runtime.executor import Shard, merge_shards

    for rank, results in enumerate(per_rank):
        losses = results[label]["losses"]
        assert len(losses) == len(expected_losses)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-5, atol=1e-6, msg=lambda m, k=rank: f"{label} rank {k} losses: {m}")
    shards = [{str(i): Shard(location, tensor) for i, (location, tensor) in enumerate(results[label]["shards"])} for results in per_rank]
    merged = merge_shards(shards, {key: tuple(value.shape) for key, value in expected_parameters.items()})
    assert merged.keys() == expected_parameters.keys(), label
    for key, value in expected_parameters.items():
        atol = next((tolerance for suffix, tolerance in (loose or {}).items() if key.endswith(suffix)), 1e-5)
        torch.testing.assert_close(merged[key], value, rtol=1e-5, atol=atol, msg=lambda m, k=key: f"{label} parameter {k}: {m}")


def die_mid_step(rank: int, world_size: int) -> tuple[str, float]:
    """Rank 1 vanishes after setup, before its first step; rank 0 must fail on its own.

    Returns (the error rank 0 got, seconds from starting the step to that error).
    """
    import os
    import time

    model, batch_size = build_model("gpt")
    batch = batches(model, batch_size, 1)[0]
    plan = lnn.parallelize(model, batch, "tp", world_size, step="training_step")
    state = dict(model.named_parameters())
    executor = RankExecutor(module_from_source(plan.sources[rank], f"rank{rank}"), rank, state, {}, TorchDistributedCommunicator(timeout=30))
    if rank == 1:
        os._exit(0)
    inputs = {tensor.name: value for tensor, value in zip(plan.graph.user_inputs, lnn.flatten_inputs(batch, step="training_step"))}
    start = time.monotonic()
    try:
        executor.forward_backward(inputs)
    except Exception as error:  # noqa: BLE001 - the error itself is the result
        return type(error).__name__, time.monotonic() - start
    return "no error", time.monotonic() - start


def raise_on_rank_1(rank: int, world_size: int) -> None:
    """Rank 1 raises ``ValueError("boom from rank 1")`` after a first barrier; rank 0 goes on to the next collective."""
    import torch.distributed as dist

    dist.barrier()
    if rank == 1:
        raise ValueError("boom from rank 1")
    dist.all_reduce(torch.ones(1))


def where_am_i(rank: int, world_size: int, variable: str) -> tuple[str | None, str, bool]:
    """This rank's value of environment ``variable``, its working directory, and whether Lightning was
    already imported before ``fn`` ran (true for a rank forked from a preloaded server)."""
    import os
    import sys

    return os.environ.get(variable), os.getcwd(), "lightning.pytorch" in sys.modules


def thread_cores(rank: int, world_size: int) -> list[set[int]]:
    """The cores each thread of this rank's process may run on (the backend's threads included)."""
    import os

    return [os.sched_getaffinity(int(thread)) for thread in os.listdir("/proc/self/task")]
