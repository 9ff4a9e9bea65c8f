"""Pipeline schedules as plain data: an ``Action`` per step, a list of actions per rank (DESIGN.md §8).

The text form follows torch.distributed.pipelining's ``_Action``: ``"1F0"`` is stage 1, forward,
microbatch 0. Communication actions carry the peer rank and an arrow that points the way the data
flows: ``"0SEND_F3->1"`` (stage 0 sends its output of microbatch 3 to rank 1) and ``"1RECV_F3<-0"``
(stage 1 receives its input of microbatch 3 from rank 0). ``SEND_B``/``RECV_B`` carry gradients the
other way: ``"1SEND_B3->0"`` sends stage 1's input gradient, ``"0RECV_B3<-1"`` receives stage 0's
output gradient. The stage of a communication action is always the stage of the rank that runs it.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass


class Kind(str, enum.Enum):
    """What an action does; the value is its text in the compact form."""

    FORWARD = "F"  # run the segment forward and stash what its backward needs
    BACKWARD = "B"  # receive output gradients, backward through the segment (input grads only when W exists)
    WEIGHT = "W"  # the weight-gradient half of B (zero-bubble schedules)
    SEND_F = "SEND_F"  # send a stage's output activation to the rank holding the next stage
    RECV_F = "RECV_F"  # receive a stage's input activation from the rank holding the previous stage
    SEND_B = "SEND_B"  # send a stage's input gradient to the rank holding the previous stage
    RECV_B = "RECV_B"  # receive a stage's output gradient from the rank holding the next stage

    @property
    def is_compute(self) -> bool:
        """True for F, B and W."""
        return self in (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT)

    @property
    def is_send(self) -> bool:
        """True for SEND_F and SEND_B."""
        return self in (Kind.SEND_F, Kind.SEND_B)

    @property
    def is_recv(self) -> bool:
        """True for RECV_F and RECV_B."""
        return self in (Kind.RECV_F, Kind.RECV_B)


F, B, W = Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT
SHARED = -1
"""``Schedule.stage_ranks`` entry of a stage that every rank runs together (split over all of them)."""
_KINDS_BY_TEXT = {kind.value: kind for kind in Kind}
_PATTERN = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|W)(\d+)(?:(->|<-)(\d+))?")


@dataclass(frozen=True, order=True)
class Action:
    """One step of a rank's program: ``kind`` on (``stage``, ``microbatch``), with ``peer`` for communication.

    Attributes:
        stage: the pipeline stage (segment) the action belongs to; for communication, the local stage.
        microbatch: the microbatch index.
        kind: see ``Kind``.
        peer: the other rank of a SEND/RECV; None for compute actions.
    """

    stage: int
    microbatch: int
    kind: Kind
    peer: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Kind(self.kind))
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(f"Action {self.stage}/{self.kind.value}/{self.microbatch}: stage and microbatch must be >= 0")
        if self.kind.is_compute != (self.peer is None):
            needs = "takes no" if self.kind.is_compute else "needs a"
            raise ValueError(f"Action kind {self.kind.value} {needs} peer rank (got {self.peer})")
        if self.peer is not None and self.peer < 0:
            raise ValueError(f"Action peer rank must be >= 0, got {self.peer}")

    def __str__(self) -> str:
        text = f"{self.stage}{self.kind.value}{self.microbatch}"
        if self.kind.is_send:
            return f"{text}->{self.peer}"
        if self.kind.is_recv:
            return f"{text}<-{self.peer}"
        return text

    @classmethod
    def parse(cls, text: str) -> Action:
        """Read the compact form back: ``Action.parse(str(action)) == action``.

        Raises:
            ValueError: when ``text`` is not ``"<stage><kind><microbatch>"`` with ``->peer`` after a SEND and
                ``<-peer`` after a RECV.
        """
        match = _PATTERN.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"cannot parse action {text!r}: expected e.g. '1F0', '0SEND_F0->1' or '1RECV_F0<-0'")
        stage, kind_text, microbatch, arrow, peer = match.groups()
        kind = _KINDS_BY_TEXT[kind_text]
        expected_arrow = "->" if kind.is_send else "<-" if kind.is_recv else None
        if arrow != expected_arrow:
            raise ValueError(f"cannot parse action {text!r}: {kind_text} needs {expected_arrow or 'no arrow'}, got {arrow or 'none'}")
        return cls(int(stage), int(microbatch), kind, None if peer is None else int(peer))


@dataclass(frozen=True)
class Schedule:
    """Every rank's ordered actions, and where each stage lives.

    Attributes:
        actions: ``actions[rank]`` is that rank's program, in the only order it runs.
        stage_ranks: ``stage_ranks[stage]`` is the rank holding that stage (for interleaved schedules rank r
            holds stages r, r + p, r + 2p, ...), or ``SHARED`` for a stage every rank runs together
            (the interlaced pipeline's large-vocabulary layers, split over all ranks: its actions are in
            every rank's list, and run like a collective).
        microbatches: the number of microbatches per step.
    """

    actions: tuple[tuple[Action, ...], ...]
    stage_ranks: tuple[int, ...]
    microbatches: int
    forward_only: int = 0
    """How many leading stages run forward only (3F1B's recycling passes: no B or W, nothing stashed)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "actions", tuple(tuple(rank_actions) for rank_actions in self.actions))
        object.__setattr__(self, "stage_ranks", tuple(self.stage_ranks))
        if not 0 <= self.forward_only < max(len(self.stage_ranks), 1):
            raise ValueError(f"forward_only ({self.forward_only}) must leave at least one of the {len(self.stage_ranks)} stages with a backward")
        bad = [rank for rank in self.stage_ranks if rank != SHARED and not 0 <= rank < len(self.actions)]
        if bad:
            raise ValueError(f"stage_ranks {self.stage_ranks} names ranks {bad} outside the {len(self.actions)} ranks of the schedule")

    @classmethod
    def from_text(cls, actions: Sequence[Sequence[str]], stage_ranks: Sequence[int], microbatches: int, forward_only: int = 0) -> Schedule:
        """Build a schedule from per-rank lists of action texts, e.g. ``[["0F0", "0B0"], ["1F0", "1B0"]]``."""
        parsed = tuple(tuple(Action.parse(text) for text in rank_actions) for rank_actions in actions)
        return cls(parsed, tuple(stage_ranks), microbatches, forward_only)

    def as_text(self) -> list[list[str]]:
        """Per-rank lists of action texts (the inverse of ``from_text``)."""
        return [[str(action) for action in rank_actions] for rank_actions in self.actions]

    @property
    def world_size(self) -> int:
        """The number of ranks."""
        return len(self.actions)

    @property
    def stages(self) -> int:
        """The number of stages."""
        return len(self.stage_ranks)

    @property
    def splits_backward(self) -> bool:
        """True when backward is split into B (input gradients) and W (weight gradients)."""
        return any(action.kind is W for rank_actions in self.actions for action in rank_actions)

    def has_backward(self, stage: int) -> bool:
        """Whether ``stage`` runs B (and W) actions: every stage but the leading ``forward_only`` ones."""
        return stage >= self.forward_only

    def stages_of_rank(self, rank: int) -> list[int]:
        """The stages ``rank`` holds (shared ones included), in increasing order."""
        return [stage for stage, holder in enumerate(self.stage_ranks) if holder in (rank, SHARED)]

    def is_shared(self, stage: int) -> bool:
        """Whether every rank runs ``stage`` (``stage_ranks[stage] == SHARED``)."""
        return self.stage_ranks[stage] == SHARED

    def holders(self, stage: int) -> list[int]:
        """The ranks that run ``stage``: all of them for a shared stage."""
        return list(range(self.world_size)) if self.is_shared(stage) else [self.stage_ranks[stage]]



def require_positive(**counts: int) -> None:
    """Raise ``ValueError`` naming the first count that is not a positive integer (generator arguments)."""
    for name, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class Timeline:
    """When each action of a schedule ran in a symbolic execution (``validate.execute``).

    Attributes:
        starts: ``starts[rank][index]`` is the start time of that rank's ``index``-th action; None when it never ran.
        ends: the matching end times.
    """

    starts: tuple[tuple[float | None, ...], ...]
    ends: tuple[tuple[float | None, ...], ...]

    @property
    def makespan(self) -> float:
        """The time the last action ends (0 for an empty schedule)."""
        return max((end for rank_ends in self.ends for end in rank_ends if end is not None), default=0.0)
