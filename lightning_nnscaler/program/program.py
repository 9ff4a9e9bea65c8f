"""``Program``: every rank's actions for one training step, in their only order, and its gradient buckets.

It is the plan's one artifact after lowering (DESIGN.md §9): the runtime dispatches each rank's actions
(``runtime.pipeline``), the simulator runs the same actions with a clock (``sim.from_plan``), and a
test checks that the simulator's sequence is what the runtime executed. ``Program.as_text`` gives each rank's
actions as texts, one per action; ``Program.from_text`` reads them back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_nnscaler.program.actions import Action, ActionKind
from lightning_nnscaler.program.buckets import BUCKET_BYTES, Bucket


@dataclass(frozen=True)
class Program:
    """Each rank's step.

    Attributes:
        actions: ``actions[rank]`` is that rank's actions, in the order it runs them.
        buckets: ``buckets[rank]`` is that rank's gradient buckets; ``REDUCE b2`` on that rank sums its bucket 2.
        zero_stage: the ZeRO stage of the replicated boxes (0, 1 or 3).
        bucket_bytes: the size the buckets were cut at.
    """

    actions: tuple[tuple[Action, ...], ...]
    buckets: tuple[tuple[Bucket, ...], ...] = ()
    zero_stage: int = 0
    bucket_bytes: int = BUCKET_BYTES

    def __post_init__(self) -> None:
        object.__setattr__(self, "actions", tuple(tuple(rank_actions) for rank_actions in self.actions))
        object.__setattr__(self, "buckets", tuple(tuple(rank_buckets) for rank_buckets in self.buckets) or ((),) * len(self.actions))
        if len(self.buckets) != len(self.actions):
            raise ValueError(f"the program has {len(self.actions)} ranks' actions but {len(self.buckets)} ranks' buckets")
        if self.zero_stage not in (0, 1, 3):
            raise ValueError(f"zero_stage must be 0, 1 or 3, got {self.zero_stage!r}")
        for rank, (rank_actions, rank_buckets) in enumerate(zip(self.actions, self.buckets)):
            for action in rank_actions:
                if action.bucket is not None and action.bucket >= len(rank_buckets):
                    raise ValueError(f"rank {rank}: {action} names a bucket, but the rank has {len(rank_buckets)} buckets")

    @property
    def world_size(self) -> int:
        """The number of ranks."""
        return len(self.actions)

    def as_text(self) -> list[list[str]]:
        """Per-rank lists of action texts."""
        return [[str(action) for action in rank_actions] for rank_actions in self.actions]

    @classmethod
    def from_text(cls, actions: Sequence[Sequence[str]], buckets: Sequence[Sequence[Bucket]] = (), zero_stage: int = 0,
                  bucket_bytes: int = BUCKET_BYTES) -> Program:
        """A program from per-rank lists of action texts (``as_text``'s inverse)."""
        return cls(tuple(tuple(Action.parse(text) for text in rank) for rank in actions), tuple(buckets), zero_stage, bucket_bytes)

    def replace_actions(self, actions: Sequence[Sequence[Action]]) -> Program:
        """The same program with other actions (a lowering pass's result)."""
        return Program(tuple(tuple(rank) for rank in actions), self.buckets, self.zero_stage, self.bucket_bytes)

    def kinds(self, rank: int) -> set[ActionKind]:
        """The kinds of action rank ``rank`` runs."""
        return {action.kind for action in self.actions[rank]}
