"""Recompute groups as code: each group becomes checkpointed functions of contiguous actions.

A group's ops run as one ``checkpoint(recompute_<group>, ...)`` call, emitted where its last op
was. That is only sound when nothing outside the group reads a member's output before the group
ends (a communication of a partial sum, an op of another device's piece). Where something does,
the group ends early there and goes on as a new block (``recompute_<group>_<n>``): every op is
still recomputed, in as few contiguous blocks as the program allows.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_nnscaler.materialize.program import Assemble, Collective, Compute, RankProgram, Send, reads, writes


@dataclass(frozen=True)
class Block:
    """One checkpointed function: part ``part`` of recompute group ``group`` (``parts`` in all)."""

    group: int
    part: int
    parts: int

    @property
    def function(self) -> str:
        """The generated function's name."""
        return f"recompute_{self.group}" if self.parts == 1 else f"recompute_{self.group}_{self.part}"


@dataclass(frozen=True)
class RecomputeBlocks:
    """Where a rank's recompute blocks are: their members (action indices) and the slices moved into them."""

    members: dict[Block, list[int]]
    block_of: dict[int, Block]
    moved_assembles: dict[int, Block]
    """Assembles of local slices read only inside one block: emitted inside it."""

    def last(self, index: int) -> bool:
        """Whether action ``index`` is the last of its block (where the block is emitted)."""
        return self.members[self.block_of[index]][-1] == index


def recompute_blocks(program: RankProgram) -> RecomputeBlocks:
    """Cut each recompute group of ``program`` into the fewest contiguous blocks."""
    groups: dict[int, list[int]] = {}
    for index, action in enumerate(program.actions):
        if isinstance(action, Compute) and action.op.recompute is not None:
            groups.setdefault(action.op.recompute, []).append(index)
    members: dict[Block, list[int]] = {}
    for group, indices in groups.items():
        runs = _contiguous_runs(program, indices)
        for part, run in enumerate(runs):
            members[Block(group, part, len(runs))] = run
    block_of = {index: block for block, indices in members.items() for index in indices}
    return RecomputeBlocks(members, block_of, _moved_assembles(program, block_of))


def _contiguous_runs(program: RankProgram, indices: list[int]) -> list[list[int]]:
    """Split a group's actions where an action outside it reads a member's output before the next member."""
    runs: list[list[int]] = [[indices[0]]]
    outputs = set(program.actions[indices[0]].output_vars)
    for previous, index in zip(indices, indices[1:]):
        between = program.actions[previous + 1:index]
        if any(_reads_outside(action) & outputs for action in between):
            runs.append([])
            outputs = set()
        runs[-1].append(index)
        outputs |= set(program.actions[index].output_vars)
    return runs


def _reads_outside(action: Any) -> set[str]:
    return set(reads(action)) if isinstance(action, (Compute, Send, Assemble, Collective)) else set()


def _moved_assembles(program: RankProgram, block_of: dict[int, Block]) -> dict[int, Block]:
    readers: dict[str, set[Block | None]] = {}
    for index, action in enumerate(program.actions):
        for var in reads(action):
            readers.setdefault(var, set()).add(block_of.get(index))
    moved: dict[int, Block] = {}
    for index, action in enumerate(program.actions):
        if isinstance(action, Assemble) and len(readers.get(action.var, set())) == 1:
            (block,) = readers[action.var]
            if block is not None:
                moved[index] = block
    return moved


def block_lines(program: RankProgram, blocks: RecomputeBlocks, block: Block, action_lines: Callable[[Any], list[str]]) -> list[str]:
    """The checkpointed function of ``block`` and its call (``action_lines`` writes one action)."""
    inner = sorted([index for index, owner in blocks.moved_assembles.items() if owner == block] + blocks.members[block])
    defined = {var for index in inner for var in writes(program.actions[index])}
    arguments = list(dict.fromkeys(var for index in inner for var in reads(program.actions[index]) if var not in defined))
    inside = set(inner)
    later_reads = {var for index, action in enumerate(program.actions) if index not in inside for var in reads(action)}
    graph_outputs = {output.var for output in program.outputs}
    results = [var for index in blocks.members[block] for var in program.actions[index].output_vars if var in later_reads or var in graph_outputs]
    lines = wrapped(f"def {block.function}(", arguments, "):  # activations recomputed in backward")
    lines += ["    " + line for index in inner for line in action_lines(program.actions[index])]
    lines.append(f"    return ({', '.join(results)}{',' if len(results) == 1 else ''})")
    targets = ", ".join(results) + ("," if len(results) == 1 else "")
    lines += wrapped(f"{targets} = checkpoint({block.function}, ", arguments, ")")
    return lines


LINE_LENGTH = 120


def wrapped(head: str, names: list[str], tail: str) -> list[str]:
    """``head``, ``names`` comma-separated and ``tail`` on one line; where that is longer than ``LINE_LENGTH``
    (a segment's block reads every parameter of its stage), the names on indented lines between them."""
    line = head + ", ".join(names) + tail
    if len(line) <= LINE_LENGTH:
        return [line]
    rows = textwrap.wrap(", ".join(names) + ",", LINE_LENGTH - 4, break_long_words=False, break_on_hyphens=False)
    return [head.rstrip(), *("    " + row for row in rows), tail]
