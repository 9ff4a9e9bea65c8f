"""Constraints: bounds on the plans a recipe or a search may make (which splits, which devices)."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from lightning_nnscaler.ir.errors import NnScalerError
from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir.op import Op


class ConstraintError(NnScalerError, ValueError):
    """A plan breaks a constraint; the message names the op and the rule."""


@dataclass(frozen=True)
class SplitRule:
    """Ops whose name or target matches ``pattern`` may be split only along ``dims`` into ``parts``."""

    pattern: str
    dims: tuple[str, ...]
    parts: tuple[int, ...]


@dataclass(frozen=True)
class PlaceRule:
    """Ops whose name or target matches ``pattern`` may only run on ``devices``."""

    pattern: str
    devices: tuple[int, ...]


@dataclass
class Constraints:
    """A set of split and placement rules; patterns are shell-style (``"aten.linear*"``, ``"embedding*"``)."""

    splits: list[SplitRule] = field(default_factory=list)
    places: list[PlaceRule] = field(default_factory=list)

    def allow_split(self, pattern: str, dims: list[str] | tuple[str, ...], parts: list[int] | tuple[int, ...]) -> Constraints:
        """Matching ops may be split only along ``dims`` into one of ``parts``."""
        self.splits.append(SplitRule(pattern, tuple(dims), tuple(parts)))
        return self

    def place(self, pattern: str, devices: list[int] | tuple[int, ...]) -> Constraints:
        """Matching ops may only be assigned to ``devices``."""
        self.places.append(PlaceRule(pattern, tuple(devices)))
        return self

    def allows_split(self, op: Op, dim: str, parts: int) -> bool:
        """Whether splitting ``op`` along ``dim`` into ``parts`` is allowed ("replicate" always is)."""
        rules = [rule for rule in self.splits if _matches(rule.pattern, op)]
        return dim == "replicate" or not rules or any(dim in rule.dims and parts in rule.parts for rule in rules)

    def allows_device(self, op: Op, device: int) -> bool:
        """Whether ``op`` may run on ``device``."""
        rules = [rule for rule in self.places if _matches(rule.pattern, op)]
        return not rules or any(device in rule.devices for rule in rules)

    def check(self, graph: Graph) -> None:
        """Raise ConstraintError for the first placed op on a device its rules forbid."""
        for op in graph.ops:
            if op.device is not None and not self.allows_device(op, op.device):
                raise ConstraintError(f"op {op.name!r} ({op.target}) is on device {op.device}, which the placement rules forbid")


def _matches(pattern: str, op: Op) -> bool:
    return any(fnmatch.fnmatchcase(text, pattern) for text in (op.name, op.source_name, op.target))
