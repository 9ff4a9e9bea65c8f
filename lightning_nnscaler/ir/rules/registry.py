"""The annotation registry: per op target, how to annotate a call and how to fix up a piece's constants.

An ``annotate`` function reads an op's arguments (pieces carry their shapes) and returns the
annotation text, or ``None`` when this particular call cannot be split. A ``rewrite`` function
receives a piece made by ``op_trans`` (inputs and outputs already cut) and returns it with its
constant arguments adjusted to the piece, e.g. a ``view`` shape or an ``arange`` range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from lightning_nnscaler.ir.op import Op

Annotate = Callable[[Op], "str | None"]
Rewrite = Callable[[Op], Op]


@dataclass(frozen=True)
class OpRule:
    """How one op target is annotated and how its pieces' constants follow a split."""

    annotate: Annotate
    rewrite: Rewrite | None = None


_RULES: dict[str, OpRule] = {}


def register_annotation(*targets: str, rewrite: Rewrite | None = None) -> Callable[[Annotate], Annotate]:
    """Decorator: register ``annotate`` (and optionally ``rewrite``) for each target name.

    Users may register rules for their own ops the same way::

        @register_annotation("mylib.fused_gelu.default")
        def fused_gelu(op): return "b s d -> b s d"
    """

    def decorate(annotate: Annotate) -> Annotate:
        for target in targets:
            _RULES[target] = OpRule(annotate, rewrite)
        return annotate

    return decorate


def rule_for(target: str) -> OpRule | None:
    """The rule registered for a target, if any."""
    return _RULES.get(target)


def annotate_op(op: Op) -> str | None:
    """Annotation text for an op, or ``None`` (replicate only) when its target has no rule."""
    rule = _RULES.get(op.target)
    return None if rule is None else rule.annotate(op)


def registered_targets() -> list[str]:
    """Every target with a rule, sorted."""
    return sorted(_RULES)
