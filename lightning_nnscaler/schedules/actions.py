"""Pipeline schedules as plain data: a list of ``program.Action`` per rank (DESIGN.md §8).

A schedule holds the compute actions (``"1F0"``: stage 1, forward, microbatch 0) and, once lowered,
the point-to-point messages between stages (``"0SEND_F3->1"``, ``"1RECV_F3<-0"``); the text form is
``program.actions``'s. The step's other actions (gradient buckets, ZeRO, the optimizer) are added when
the schedule becomes the plan's ``program.Program``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_nnscaler.program.actions import Action, ActionKind

F, B, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT
Kind = ActionKind
"""The schedules' name for ``program.ActionKind`` (a schedule holds only its compute and message kinds)."""
SHARED = -1
"""``Schedule.stage_ranks`` entry of a stage that every rank runs together (split over all of them)."""


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
