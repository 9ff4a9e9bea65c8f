"""RankExecutor.pieces(): what each rank's optimizer updates and where it lies in the full model."""

from __future__ import annotations

import pytest
import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.codegen import module_from_source
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.runtime import run_ranks
from lightning_nnscaler.runtime.executor import RankExecutor

pytestmark = pytest.mark.timeout(60)


def pieces_under(recipe: str) -> tuple[dict[str, torch.Tensor], list[list[tuple[str, tuple, tuple | None, int, torch.Tensor]]]]:
    """The model's parameters and, per rank, (state key, box, chunk, replicas, values) of every piece."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.small())
    plan = lnn.parallelize(model, model.example_batch(4, torch.Generator().manual_seed(0)), recipe, 2, step="training_step")
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}

    def program(comm):
        executor = RankExecutor(module_from_source(plan.sources[comm.rank], f"rank{comm.rank}"), comm.rank, state, plan.graph.constant_values, comm)
        assert [id(piece.tensor) for piece in executor.pieces()] == [id(tensor) for tensor in executor.parameters()]
        return [(p.location.state_key, p.location.box, p.location.chunk, p.replicas, p.tensor.detach().clone()) for p in executor.pieces()]

    return dict(model.named_parameters()), run_ranks(2, program, timeout=30)


def test_dp_pieces_are_whole_parameters_held_by_both_ranks():
    parameters, per_rank = pieces_under("dp")
    for pieces in per_rank:
        assert {key for key, *_ in pieces} == set(parameters)
        for key, box, chunk, replicas, values in pieces:
            assert box == tuple((0, size) for size in parameters[key].shape) and chunk is None and replicas == 2
            assert torch.equal(values, parameters[key].detach())


def test_zero1_pieces_are_each_ranks_chunk_of_the_flattened_box():
    parameters, per_rank = pieces_under("zero1")
    for rank, pieces in enumerate(per_rank):
        assert {key for key, *_ in pieces} == set(parameters)
        for key, box, chunk, replicas, values in pieces:
            index, size = chunk
            flat = torch.nn.functional.pad(parameters[key].detach().reshape(-1), (0, 2 * size - parameters[key].numel()))
            assert index == rank and replicas == 1 and torch.equal(values, flat[index * size : (index + 1) * size])
