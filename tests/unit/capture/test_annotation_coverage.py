"""The annotation registry covers every op the project's graphs contain.

The graphs are those of ``tests/support/op_cases.py``: the four reference models and Hugging Face
GPT-2, BERT, T5, timm Swin and ViT. Run with ``-s`` to see the coverage table.
"""

from __future__ import annotations

from support.op_cases import MODEL_NAMES, all_op_cases, all_targets, coverage_table, traced

from lightning_nnscaler.ir.rules import rule_for
from lightning_nnscaler.ir.annotation import AnnotationError

# Op targets the graphs contain that are deliberately left without a rule (replicate only), each
# with its reason. Empty: every op the graphs produce has a rule. Add an entry only for an op
# whose split cannot be exact, and say why.
REPLICATE_ONLY: dict[str, str] = {}


def test_every_op_target_has_a_rule_or_is_replicate_only() -> None:
    missing = {target: models for target, models in all_targets().items() if rule_for(target) is None and target not in REPLICATE_ONLY}
    assert not missing, f"op targets without an annotation rule (write one, or list it in REPLICATE_ONLY with a reason): {missing}"


def test_replicate_only_lists_only_ops_that_occur_and_have_no_rule() -> None:
    targets = all_targets()
    stale = {target for target in REPLICATE_ONLY if target not in targets or rule_for(target) is not None}
    assert not stale, f"REPLICATE_ONLY entries that no graph needs: {sorted(stale)}"
    assert all(reason.strip() for reason in REPLICATE_ONLY.values())


def test_every_op_call_is_annotated() -> None:
    # A rule may decline one call (returning None): that call is then replicate-only too.
    unannotated = [
        f"{model}:{op.name} ({op.target})"
        for model in MODEL_NAMES
        for op in traced(model)[0].ops
        if op.annotation is None and op.target not in REPLICATE_ONLY
    ]
    assert not unannotated, f"op calls whose rule gave no annotation: {unannotated}"


def test_every_annotation_fits_its_op() -> None:
    misfits = []
    for case in all_op_cases():
        if case.dims is None:
            continue
        try:
            case.name_sizes()
        except AnnotationError as error:
            misfits.append(f"{case!r}: {error}")
    assert not misfits, "\n".join(misfits)


def test_coverage_table() -> None:
    table = coverage_table()
    print("\n" + table)
    rows = table.splitlines()[1:]
    assert [row.split()[0] for row in rows] == list(all_targets())
    assert len(rows) == len({case.target for case in all_op_cases()} | set(all_targets()))
