"""Scale by symmetry: simulate one rank per pipeline stage of a uniform dp × tp × pp plan, not every rank.

Every data-parallel replica and every tensor-parallel peer of a stage runs the same task list, reaches each
collective of its groups at the same time as the group's other members and gets its messages at the same
times, so its clock, busy / communication / idle seconds and memory are those of one representative: replica
0's piece 0 of the stage (rank ``stage · tp`` in ``hybrid3d``'s layout). The representatives' lists
(``analytic.transformer_task_lists(..., representatives=True)``) hold each collective over a ``StandIn``
group, one member long, that the engine waits on alone and that ``SymmetricComm`` prices as the whole group
it stands for; messages between stages are priced between the representatives' real ranks. The simulated
representatives then stand for every rank (``expand``): the same floating-point operations in the same order,
so the times and bytes equal the rank-by-rank simulation's exactly, with ``pp`` lists instead of
``dp · tp · pp``.

That holds when the communication model prices a collective by its kind, size and group size and by whether
the group spans nodes, and a message by whether its two ranks share a node (``costs.CommModel``), and every
replica and peer of a stage meets the same links as the representative (``symmetric_layout``): true whenever
``tp`` divides the node or the node ``tp``, and stages and replicas align with nodes the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_nnscaler.sim.results import CommunicationModel, RankStats, SimResult


class StandIn(tuple):
    """A representative's group: ``(rank,)`` in the symmetric lists, standing for ``whole`` (the real ranks of
    the group, priced by ``SymmetricComm``). Equal and hashed by both, so a stage's tp and dp groups stay two
    groups (two communication streams) exactly where the whole groups are two."""

    whole: tuple[int, ...]

    def __new__(cls, rank: int, whole: tuple[int, ...]) -> StandIn:
        group = super().__new__(cls, (rank,))
        group.whole = whole
        group._hash = hash((rank, whole))
        return group

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StandIn) and tuple.__eq__(self, other) and self.whole == other.whole

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):  # pickles as itself, not as a plain tuple
        return StandIn, (self[0], self.whole)


class SymmetricComm:
    """``comm`` for the representatives' lists: list ``i``'s messages are priced as from rank ``ranks[i]``, a
    ``StandIn`` collective as over its whole group (implements ``results.CommunicationModel``)."""

    def __init__(self, comm: CommunicationModel, ranks: Sequence[int]) -> None:
        self.comm, self.ranks = comm, list(ranks)

    def p2p_seconds(self, src: int, dst: int, nbytes: int) -> tuple[float, float]:
        return self.comm.p2p_seconds(self.ranks[src], self.ranks[dst], nbytes)

    def collective_seconds(self, kind: str, group: tuple[int, ...], nbytes: int) -> float:
        whole = group.whole if isinstance(group, StandIn) else tuple(self.ranks[member] for member in group)
        return self.comm.collective_seconds(kind, whole, nbytes)


def symmetric_layout(ranks_per_node: int, *, dp: int, tp: int, pp: int, wrap: bool = False) -> bool:
    """Whether every rank of each stage meets the links its representative meets (``rank = (replica · pp + stage)
    · tp + piece``): its tp group and its dp group within one node or not alike, and its messages to the stages
    beside it within a node or not alike (``wrap``: an interleaved pipeline's, whose last stage also sends to its
    first). Linear in the ranks, integer arithmetic only."""
    def node(rank: int) -> int:
        return rank // ranks_per_node

    def links(replica: int, stage: int, piece: int) -> tuple[bool, ...]:
        rank = (replica * pp + stage) * tp + piece
        first = rank - piece
        tp_spans = node(first) != node(first + tp - 1)
        dp_spans = node(stage * tp + piece) != node(((dp - 1) * pp + stage) * tp + piece)
        beside = tuple(node(rank) != node(rank + ((stage + step) % pp - stage) * tp) for step in (-1, 1)
                       if wrap or 0 <= stage + step < pp)
        return (tp_spans, dp_spans, *beside)

    for stage in range(pp):
        expected = links(0, stage, 0)
        if any(links(replica, stage, piece) != expected for replica in range(dp) for piece in range(tp)):
            return False
    return True


def representative_ranks(*, tp: int, pp: int) -> list[int]:
    """Each stage's representative: replica 0's piece 0, rank ``stage · tp``."""
    return [stage * tp for stage in range(pp)]


def expand(result: SimResult, *, dp: int, tp: int, pp: int) -> SimResult:
    """The representatives' result as every rank's: rank ``r`` of stage ``r // tp % pp`` gets its stage's
    ``RankStats`` (the same object: ranks of a stage share it) and spans."""
    stage_of = [rank // tp % pp for rank in range(dp * tp * pp)]
    ranks: list[RankStats] = [result.ranks[stage] for stage in stage_of]
    spans = [result.spans[stage] for stage in stage_of] if result.spans else []
    return SimResult(result.step_seconds, ranks, spans)
