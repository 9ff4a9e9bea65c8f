"""What ops and messages cost: work per op (FLOPs, bytes), roofline time on a ``HardwareSpec``, α–β communication.

Work of an op (forward): ``ir.work.op_work``, the rule the pipeline stages are balanced with too
(``plans.pipeline.op_cost``).

Roofline (Williams et al. 2009): ``overhead + max(FLOPs / (peak[dtype]·matmul_efficiency),
bytes / (bandwidth·memory_efficiency))``. Backward costs twice the forward's work (input and
weight gradients, each a matmul of the forward's size); an op with no floating input or output,
or under ``no_grad``, has no backward.

Communication, α–β per collective with the ring conventions of ``explain`` (bytes one rank sends
for a buffer of ``n`` bytes among ``p`` ranks): all-reduce ``2(p-1)/p·n`` in ``2(p-1)`` steps;
all-gather, reduce-scatter, all-to-all and broadcast ``(p-1)/p·n`` in ``p-1`` steps; a message
``n`` in one. Time = steps·latency + ring bytes / bandwidth over the slowest link the group spans
(inter-node when its ranks are on more than one node), or a fitted ``alpha + beta·ring bytes``
from the spec's ``collectives`` table when it has one for the kind and group size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from lightning_nnscaler.explain import ring_bytes as explain_ring_bytes
from lightning_nnscaler.ir.op import Op
from lightning_nnscaler.ir.work import ADD_MATMULS, ATTENTION, CONVOLUTIONS, MATMULS, VIEWS, OpWork, op_work  # noqa: F401 - the shared rule
from lightning_nnscaler.ir.tensor import FLOATING  # noqa: F401 - the simulator's modules read it here
from lightning_nnscaler.sim.specs import HardwareSpec, Link, measured_for

@dataclass(frozen=True)
class OpTime:
    """Seconds of one op's forward and of its backward (0 when it has none)."""

    forward: float
    backward: float


class ComputeModel(Protocol):
    """Per-op time on one device (``Roofline``, ``profile.Profiled``)."""

    def op_time(self, op: Op) -> OpTime:
        """Forward and backward seconds of ``op``."""


def roofline_seconds(spec: HardwareSpec, flops: float, nbytes: float, dtype: str = "float32", matmul: bool = True) -> float:
    """Time of ``flops`` and ``nbytes`` on ``spec`` (no per-op overhead): the slower of compute and memory."""
    rate = spec.flops(dtype) * (spec.matmul_efficiency if matmul else 1.0)
    return max(flops / rate, nbytes / (spec.memory_bandwidth * spec.memory_efficiency))


@dataclass(frozen=True)
class Roofline:
    """The analytic compute model on ``spec`` (see the module docstring)."""

    spec: HardwareSpec

    def op_time(self, op: Op) -> OpTime:
        """Forward and backward seconds of ``op``: overhead plus roofline; backward twice the work."""
        work = op_work(op)
        forward = self.spec.op_overhead_s + roofline_seconds(self.spec, work.flops, work.nbytes, work.dtype, work.matmul)
        if not work.has_backward:
            return OpTime(forward, 0.0)
        backward = self.spec.op_overhead_s + 2 * roofline_seconds(self.spec, work.flops, work.nbytes, work.dtype, work.matmul)
        return OpTime(forward, backward)

    def optimizer_seconds(self, elements: int, element_bytes: int = 4) -> float:
        """One AdamW step over ``elements``: memory-bound, reading parameter, gradient and two moments
        and writing parameter and moments (7 tensors' bytes), plus one overhead per tensor kind."""
        return 4 * self.spec.op_overhead_s + 7 * elements * element_bytes / (self.spec.memory_bandwidth * self.spec.memory_efficiency)


def ring_bytes(kind: str, ranks: int, nbytes: float) -> float:
    """Bytes one rank sends in a ring ``kind`` over ``ranks`` on a buffer of ``nbytes`` (``explain``'s convention; a message: all of it)."""
    return float(nbytes) if kind in ("send", "recv", "p2p") else float(explain_ring_bytes(kind, ranks, int(nbytes)))


def ring_steps(kind: str, ranks: int) -> int:
    """Latency-bound steps of a ring ``kind``: all-reduce ``2(p-1)``, the others ``p-1``, a message 1."""
    if kind in ("send", "recv", "p2p"):
        return 1
    return (2 if kind == "all_reduce" else 1) * (ranks - 1)


@dataclass(frozen=True)
class CommModel:
    """α–β communication on ``spec``'s links, or its fitted table (implements ``simulate.CommunicationModel``).

    ``world_size``: the ranks of the run. A fitted message time (``p2p``) is taken from the table's entry
    for the most ranks not above it: on a machine whose ranks share cores (``cores_per_node``), a message
    between two ranks costs more when other ranks keep the cores busy, and the calibration measures it so.
    """

    spec: HardwareSpec
    world_size: int = 2

    def link(self, ranks: tuple[int, ...]) -> Link:
        """The slowest link among ``ranks``: inter-node when they lie on more than one node."""
        nodes = {rank // self.spec.ranks_per_node for rank in ranks}
        return self.spec.inter_node if len(nodes) > 1 else self.spec.intra_node

    def p2p_seconds(self, src: int, dst: int, nbytes: int) -> tuple[float, float]:
        """(latency, transfer seconds) of one message."""
        fit = measured_for(self.spec.collectives.get("p2p", {}), self.world_size)
        if fit is not None:
            return fit[0], fit[1] * nbytes
        link = self.link((src, dst))
        return link.latency, nbytes / link.bandwidth

    def collective_seconds(self, kind: str, group: tuple[int, ...], nbytes: int) -> float:
        """Seconds of one ``kind`` over ``group`` on a buffer of ``nbytes`` per rank (0 for a group of one)."""
        ranks = len(group)
        if ranks < 2:
            return 0.0
        moved = ring_bytes(kind, ranks, nbytes)
        fit = self.spec.collectives.get(kind, {}).get(ranks)
        if fit is not None:
            return fit[0] + fit[1] * moved
        link = self.link(group)
        return ring_steps(kind, ranks) * link.latency + moved / link.bandwidth
