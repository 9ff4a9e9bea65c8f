"""Variable names of the per-rank programs: a tensor-derived identifier, suffixed ``_1``, ``_2``, ... when the rank has it.

A rank's program names tens of thousands of variables after a few hundred tensors (every microbatch and piece
of ``linear`` is a ``linear``), so trying ``name``, ``name_1``, ... from the start each time would cost
O(copies²) per name. Names are never freed, so the search for a name resumes after the last suffix given.
"""

from __future__ import annotations

import itertools


class VariableNames:
    """The names given so far on each of ``world_size`` ranks."""

    def __init__(self, world_size: int) -> None:
        self.used: list[set[str]] = [set() for _ in range(world_size)]
        self._next_suffix: dict[tuple[int, str], int] = {}  # (rank, identifier) -> first suffix not yet tried
        self._identifiers: dict[str, str] = {}  # text -> the identifier it becomes

    def new(self, rank: int, base: str) -> str:
        """A name for a new variable on ``rank`` after ``base`` (a tensor name: ``.`` and others become ``_``)."""
        name = self._identifiers.get(base)
        if name is None:
            name = "".join(c if c.isalnum() or c == "_" else "_" for c in base)
            if not name or name[0].isdigit():
                name = "t_" + name
            self._identifiers[base] = name
        start = self._next_suffix.get((rank, name), 1)
        candidate = name if start == 1 else f"{name}_{start - 1}"
        for index in itertools.count(start):
            if candidate not in self.used[rank]:
                break
            candidate = f"{name}_{index}"
        self._next_suffix[(rank, name)] = index + 1
        self.used[rank].add(candidate)
        return candidate
