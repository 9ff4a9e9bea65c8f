"""Every rank's generated module, each written the first time it is asked for.

A rank runs only its own module, so generating all of them up front costs every rank the whole world's
code generation (seconds per hundred ranks). ``RankSources`` is the list of sources as a sequence that
emits rank ``r``'s module on first access (``emit_rank``) and keeps it; iterating, ``len`` and pickling
behave as for the list (pickling writes every rank's source).

A plan made for one rank materializes and lowers that rank alone (``Lowered``: ``Program.local_rank``); another
rank's module is then emitted from every rank's materialization, built the first time one is asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, overload

from lightning_nnscaler.codegen.emit import emit_rank
from lightning_nnscaler.materialize.program import Program
from lightning_nnscaler.materialize.releases import rank_releases
from lightning_nnscaler.program import Program as StepProgram


class Lowered:
    """A plan's materialization and its step's program as built (every rank's, or one rank's: ``Program.local_rank``),
    and every rank's, from ``whole``, the first time they are asked for."""

    def __init__(self, materialized: Program, steps: StepProgram, whole: Callable[[], tuple[Program, StepProgram]] | None = None) -> None:
        """``whole`` builds every rank's (needed only when ``materialized`` is rank-local)."""
        if materialized.local_rank is not None and whole is None:
            raise ValueError(f"a materialization of rank {materialized.local_rank} alone needs a way to build every rank's")
        self.materialized = materialized
        self.steps = steps
        self._whole = whole
        self._built: tuple[Program, StepProgram] | None = None

    def whole(self) -> tuple[Program, StepProgram]:
        """Every rank's materialization and step program (built now if they were rank-local)."""
        if self.materialized.local_rank is None:
            return self.materialized, self.steps
        if self._built is None:
            self._built = self._whole()
        return self._built

    def __getstate__(self) -> dict[str, Any]:
        """Pickled as every rank's (``whole`` may be a closure, which does not pickle)."""
        materialized, steps = self.whole()
        return {"materialized": materialized, "steps": steps, "_whole": None, "_built": None}

    def of_rank(self, rank: int) -> tuple[Program, StepProgram]:
        """A materialization and step program in which ``rank``'s part is whole."""
        return (self.materialized, self.steps) if self.materialized.local_rank in (None, rank) else self.whole()


class RankSources(Sequence[str]):
    """Rank ``r``'s module source as ``sources[r]``, generated on first access (see the module docstring)."""

    def __init__(self, lowered: Lowered, plan_hash: str, label: str) -> None:
        """``lowered``: the materialization and the step's program (each rank's actions and buckets); ``plan_hash``: the
        hash the headers quote."""
        self.lowered = lowered
        self.plan_hash = plan_hash
        self.label = label
        self._sources: dict[int, str] = {}

    def __len__(self) -> int:
        return self.lowered.materialized.world_size

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
        program, steps = self.lowered.of_rank(rank)
        releases = rank_releases(program, steps, rank) if program.pipelined else None
        return emit_rank(program, rank, self.plan_hash, self.label, steps.zero_stage, steps.actions[rank], steps.buckets[rank], releases)
