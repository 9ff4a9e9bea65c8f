"""The simulator prices the very program the runtime runs: for every catalog recipe at 2 and 4 ranks, each rank's
sequence of simulated actions equals the sequence its executor ran (recorded by the runtime), bucket by bucket."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.codegen import module_from_source
from lightning_nnscaler.models.evoformer import Evoformer, EvoformerConfig
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.plans.catalog import list_recipes
from lightning_nnscaler.runtime.executor import RankExecutor
from lightning_nnscaler.runtime.memory_comm import run_ranks
from lightning_nnscaler.sim.from_plan import plan_task_lists
from lightning_nnscaler.sim.predict import DeviceModel
from lightning_nnscaler.sim.costs import Roofline
from lightning_nnscaler.sim.specs import load_spec

BUCKET_BYTES = 16 * 1024
"""Small buckets, so that every replicated rank sums several."""

PARAMS = {
    2: {"coshard": {"shards": 2}, "hybrid": {"dp": 1, "tp": 2}, "hybrid3d": {"dp": 1, "tp": 1, "pp": 2}, "interleaved": {"virtual_stages": 2},
        "auto": {"recipes": "dp,zero3,1f1b"}},
    4: {"coshard": {"shards": 1}, "hybrid": {"dp": 2, "tp": 2}, "hybrid3d": {"dp": 2, "tp": 1, "pp": 2}, "interleaved": {"virtual_stages": 2},
        "1f1b": {"stages": 2}, "gpipe": {"stages": 2}, "zb1": {"stages": 2}, "3f1b": {"stages": 2}, "auto": {"recipes": "zero1,hybrid3d"}},
}
"""Parameters that fit GPTConfig.small() (4 layers, 4 heads) at each rank count; the catalog's defaults otherwise."""
V_SHAPED = ("zbv", "vhalf", "dualpipev")
"""Two stages per rank: a GPT with a layer per stage, so that no tensor skips a stage."""
SKIPPED = {"interlaced": "needs a model with a shared large vocabulary (tests/unit/plans/test_interlaced_plan.py covers its program)"}


ZERO_CASES = [("hybrid3d zero=3", 4), ("hybrid3d zero=1", 4), ("1f1b zero=3", 4)]
"""Pipelines with ZeRO over their stages' replicas: gathers before the first forward, one reduce-scatter per bucket."""


def cases() -> list[tuple[str, int]]:
    names = [spec.name for spec in list_recipes() if spec.name not in SKIPPED]
    return list(itertools.product(names, (2, 4))) + ZERO_CASES


def case_params(case: str, world_size: int) -> tuple[str, dict]:
    """The recipe of a case (``"hybrid3d zero=3"``) and its parameters: ``PARAMS``', then the case's own."""
    recipe, *extra = case.split()
    return recipe, {**PARAMS[world_size].get(recipe, {}), **{key: int(value) for key, value in (item.split("=") for item in extra)}}


def simulated_sequence(tasks: list) -> list[str]:
    """The actions a rank's task list runs, in order: each task's label, repeats of one action merged, the prologue left out."""
    sequence: list[str] = []
    for task in tasks:
        if task.label and task.label != "prologue" and (not sequence or sequence[-1] != task.label):
            sequence.append(task.label)
    return sequence


def executed_sequences(plan: lnn.Plan) -> list[list[str]]:
    """Each rank's actions as its executor ran them: one training step and the optimizer's (in-memory ranks)."""
    inputs = plan.inputs()
    state = {**dict(plan.module.named_parameters()), **dict(plan.module.named_buffers())}

    def run_rank(communicator) -> list[str]:
        rank = communicator.rank
        executor = RankExecutor(module_from_source(plan.sources[rank], f"one_program_rank{rank}"), rank, state, plan.graph.constant_values,
                                communicator, input_offsets=plan.input_offsets(rank))
        executor.forward_backward(plan.replica_inputs(rank, inputs))
        executor.after_optimizer_step()
        return [text for text, _, _ in executor.executed_actions]

    return run_ranks(plan.world_size, run_rank, timeout=120)


@pytest.mark.parametrize(("recipe", "world_size"), cases(), ids=lambda value: str(value))
def test_the_simulator_runs_the_actions_the_runtime_ran(recipe: str, world_size: int) -> None:
    recipe, params = case_params(recipe, world_size)
    torch.manual_seed(0)
    if recipe == "3f1b":  # pipelines recycling passes: a model that recycles
        model = Evoformer(dataclasses.replace(EvoformerConfig.small(), recycles=3))
    else:
        model = GPT(dataclasses.replace(GPTConfig.small(), layers=2 * world_size) if recipe in V_SHAPED else GPTConfig.small())
    batch = model.example_batch(8, torch.Generator().manual_seed(0))
    plan = lnn.parallelize(model, batch, recipe, world_size, step="training_step", bucket_bytes=BUCKET_BYTES, **params)
    spec = load_spec("cpu")
    simulated = [simulated_sequence(tasks) for tasks in plan_task_lists(plan, DeviceModel(spec, Roofline(spec)).for_ranks(world_size))]
    executed = executed_sequences(plan)
    for rank in range(world_size):
        assert simulated[rank] == executed[rank] == plan.program.as_text()[rank], f"rank {rank}"
    if plan.program.buckets[0]:
        assert plan.program.bucket_bytes == BUCKET_BYTES
        assert sum(text.startswith("REDUCE") for text in executed[0]) == len(plan.program.buckets[0])
