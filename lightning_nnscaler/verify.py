"""Equivalence check: a partitioned graph must give the single-device losses and gradients."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_nnscaler.ir.errors import NnScalerError
from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir.interpret import run_graph
from lightning_nnscaler.ir.rules.batch_norm import BATCH_DIM, per_piece_statistics
from lightning_nnscaler.primitives.trans import op_trans


class EquivalenceError(NnScalerError, AssertionError):
    """A plan's result differs from the reference; the message names the first mismatch."""


@dataclass(frozen=True)
class Evaluation:
    """Outputs and the gradients of every input that requires grad, by tensor name."""

    outputs: dict[str, torch.Tensor]
    gradients: dict[str, torch.Tensor]


def evaluate(graph: Graph, inputs: dict[str, torch.Tensor], seed: int = 0, backward_from: list[str] | None = None) -> Evaluation:
    """Run ``graph`` forward and backward on copies of ``inputs``.

    Backward starts from every output that requires grad (or those of ``backward_from``, e.g. a
    step's loss and not its logged values): a scalar output (the loss) with weight 1, others with a
    fixed random weighting, so every element's gradient path is checked.
    """
    leaves = {}
    for name, value in inputs.items():
        tensor = graph.tensors.get(name)
        leaf = value.detach().clone()
        if tensor is not None and (tensor.requires_grad or (tensor.role == "input" and leaf.is_floating_point())):
            leaf.requires_grad_(True)
        leaves[name] = leaf
    outputs = run_graph(graph, leaves)
    generator = torch.Generator().manual_seed(seed)
    seeds = []
    for name in graph.outputs if backward_from is None else backward_from:
        output = outputs[name]
        if output.requires_grad:
            weights = torch.randn(output.shape, generator=generator, dtype=output.dtype) if output.dim() else torch.ones((), dtype=output.dtype)
            seeds.append((output * weights).sum())
    if seeds:
        torch.stack(seeds).sum().backward()
    gradients = {name: leaf.grad for name, leaf in leaves.items() if leaf.requires_grad and leaf.grad is not None}
    return Evaluation({name: value.detach() for name, value in outputs.items()}, gradients)


def replica_reference(graph: Graph, replicas: int, microbatches: int = 1) -> Graph:
    """The single-device reference of a plan with ``replicas`` data-parallel replicas, each running its rows
    as ``microbatches`` microbatches (a pipeline's, per replica; 1 otherwise): ``graph`` with each op whose
    statistics are per piece of the batch (training-mode BatchNorm) cut into ``replicas × microbatches`` pieces.

    Such ops normalize each replica's rows with that replica's statistics, as ddp does, and under a
    pipeline each microbatch's rows with that microbatch's (as ``torch.distributed.pipelining`` does: the
    plan's ``split_batch`` cuts the batch replica-major into as many equal row ranges, the ones cut here);
    every other op is as one device runs it, so the oracle stays "equal to one device", with those statistics.
    """
    pieces = replicas * microbatches
    cut = [op for op in graph.ops if per_piece_statistics(op) and op.annotation and BATCH_DIM in op.annotation]
    if pieces <= 1 or not cut:
        return graph
    reference = graph.copy()
    for op in cut:
        op_trans(reference, op.name, BATCH_DIM, pieces)
    return reference


def assert_equivalent(reference: Graph, plan: Graph, inputs: dict[str, torch.Tensor], *, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Raise EquivalenceError unless ``plan`` gives ``reference``'s outputs and gradients."""
    expected, actual = evaluate(reference, inputs), evaluate(plan, inputs)
    _compare("output", expected.outputs, actual.outputs, rtol, atol)
    _compare("gradient of", expected.gradients, actual.gradients, rtol, atol)


def _compare(kind: str, expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor], rtol: float, atol: float) -> None:
    if expected.keys() != actual.keys():
        raise EquivalenceError(f"{kind}: reference has {sorted(expected)}, plan has {sorted(actual)}")
    for name, value in expected.items():
        other = actual[name]
        if value.shape != other.shape or not torch.allclose(value, other, rtol=rtol, atol=atol, equal_nan=True):
            difference = (value.double() - other.double()).abs().max().item() if value.shape == other.shape else "shape"
            raise EquivalenceError(f"{kind} %{name} differs from the single-device value (max abs difference {difference})")
