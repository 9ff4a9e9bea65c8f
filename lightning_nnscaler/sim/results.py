"""What a simulation returns, and the two things it is given besides the lists: a communication model and the machine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class CommunicationModel(Protocol):
    """How long messages and collectives take (``sim.costs.CommModel`` implements it)."""

    def p2p_seconds(self, src: int, dst: int, nbytes: int) -> tuple[float, float]:
        """(latency, transfer seconds) of one message of ``nbytes`` from ``src`` to ``dst``."""

    def collective_seconds(self, kind: str, group: tuple[int, ...], nbytes: int) -> float:
        """Seconds of one ``kind`` collective over ``group`` on a buffer of ``nbytes`` per rank."""


@dataclass(frozen=True)
class Machine:
    """Where the ranks run: ``ranks_per_node`` consecutive ranks per node; ``cores_per_node`` compute slots
    shared by a node's ranks (None: one device per rank, no sharing); ``busy_issue_seconds`` what issuing a
    send or starting an asynchronous collective holds a rank while every core of its node computes (``HardwareSpec.busy_issue_s``);
    ``late_receive_seconds`` how long a receive posted after its message was sent takes on shared cores
    (``HardwareSpec.late_receive_s``); on shared cores, how uncertain a rank's clock is (``sim.jitter``;
    ``HardwareSpec.jitter``): ``meeting_jitter_seconds`` when it leaves a wait for other ranks, plus
    ``compute_jitter`` × the compute it ran since (standard deviations)."""

    ranks_per_node: int = 8
    cores_per_node: int | None = None
    busy_issue_seconds: float = 0.0
    late_receive_seconds: float = 0.0
    meeting_jitter_seconds: float = 0.0
    compute_jitter: float = 0.0


@dataclass
class RankStats:
    """Seconds a rank spent busy (compute), communicating and idle; its peak of activations kept for backward, and
    its peak of everything the schedule holds (kept activations, outputs not yet freed, gradients in flight,
    parameter gradients made so far), in bytes."""

    busy: float = 0.0
    communication: float = 0.0
    idle: float = 0.0
    end: float = 0.0
    peak_activation_bytes: int = 0
    peak_live_bytes: int = 0
    gradient_bytes: int = 0
    """Parameter gradients the step's backward made (those not held all along in the reducer's buckets)."""
    gradients_at_peak: int = 0
    """How many of those existed when ``peak_live_bytes`` was reached."""
    sent_bytes: int = 0
    """Copies of the messages the rank sent and still holds: the runtime keeps each until it waits for its sends
    after backward, or, in a pipeline, until a later message from the peer proves it taken (``Recv.releases``)."""

    def note_live(self, nbytes: int) -> None:
        """Raise ``peak_live_bytes`` to ``nbytes`` plus the messages sent so far when it is higher (and note the
        gradients made by then)."""
        nbytes += self.sent_bytes
        if nbytes > self.peak_live_bytes:
            self.peak_live_bytes, self.gradients_at_peak = nbytes, self.gradient_bytes


@dataclass
class Span:
    """One interval of a rank's timeline (recorded with ``record=True``): ``kind`` is the task's kind or idle."""

    kind: str
    start: float
    end: float
    label: str = ""


@dataclass
class SimResult:
    """The simulated step."""

    step_seconds: float
    ranks: list[RankStats]
    spans: list[list[Span]] = field(default_factory=list)

    @property
    def bubble_fraction(self) -> float:
        """``1 - compute / (ranks × step)``."""
        total = self.step_seconds * len(self.ranks)
        return 1.0 - sum(rank.busy for rank in self.ranks) / total if total else 0.0
