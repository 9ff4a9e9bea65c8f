"""Op semantics: per op target, its dimension annotation and how a piece's constants follow a split.

Importing this package registers every built-in rule (``batch_norm``, ``common``, ``networks``, ``pooling``, ``shape``); capture
annotates the ops it converts with them and ``op_trans`` cuts ops by them.
"""

from lightning_nnscaler.ir.rules.registry import OpRule, annotate_op, register_annotation, registered_targets, rule_for
from lightning_nnscaler.ir.rules import batch_norm, common, networks, pooling, shape  # noqa: F401, E402 - registers the built-in rules

__all__ = ["OpRule", "annotate_op", "register_annotation", "registered_targets", "rule_for"]
