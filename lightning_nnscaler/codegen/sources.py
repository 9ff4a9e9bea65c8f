"""Every rank's generated module, each written the first time it is asked for.

A rank runs only its own module, so generating all of them up front costs every rank the whole world's
code generation (seconds per hundred ranks). ``RankSources`` is the list of sources as a sequence that
emits rank ``r``'s module on first access (``emit_rank``) and keeps it; iterating, ``len`` and pickling
behave as for the list (pickling writes every rank's source).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

from lightning_nnscaler.codegen.emit import emit_rank
from lightning_nnscaler.materialize.program import Program
from lightning_nnscaler.materialize.releases import rank_releases
from lightning_nnscaler.program import Program as StepProgram


class RankSources(Sequence[str]):
    """Rank ``r``'s module source as ``sources[r]``, generated on first access (see the module docstring)."""

    def __init__(self, program: Program, steps: StepProgram, plan_hash: str, label: str) -> None:
        """``steps``: the step's program (each rank's actions and buckets); ``plan_hash``: the hash the headers quote."""
        self.program = program
        self.steps = steps
        self.plan_hash = plan_hash
        self.label = label
        self._sources: dict[int, str] = {}

    def __len__(self) -> int:
        return self.program.world_size

    @overload
    def __getitem__(self, rank: int) -> str: ...

    @overload
    def __getitem__(self, rank: slice) -> list[str]: ...

    def __getitem__(self, rank: int | slice) -> str | list[str]:
        if isinstance(rank, slice):
            return [self[index] for index in range(*rank.indices(len(self)))]
        if rank < 0:
            rank += len(self)
        if not 0 <= rank < len(self):
            raise IndexError(f"rank {rank} is outside the plan's {len(self)} ranks")
        if rank not in self._sources:
            self._sources[rank] = self._emit(rank)
        return self._sources[rank]

    def __iter__(self) -> Iterator[str]:
        return (self[rank] for rank in range(len(self)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __reduce__(self) -> tuple[Any, ...]:
        return list, (list(self),)

    def generate(self, ranks: Iterable[int]) -> None:
        """Generate these ranks' modules now, so that a plan that cannot be written as code fails at planning."""
        for rank in ranks:
            self[rank]

    def generated(self) -> list[int]:
        """The ranks whose source has been generated so far."""
        return sorted(self._sources)

    def _emit(self, rank: int) -> str:
        releases = rank_releases(self.program, self.steps, rank) if self.program.pipelined else None
        return emit_rank(self.program, rank, self.plan_hash, self.label, self.steps.zero_stage, self.steps.actions[rank], self.steps.buckets[rank], releases)
