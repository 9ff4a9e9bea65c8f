"""Every split an op's annotation allows is exact, for every op kind the project's graphs contain.

The cases are the distinct op calls (target, annotation, input shapes and dtypes) of nine traced
models, each with the input values it really receives, plus those of an "op zoo" that calls the
ops with a rule that no model produces (``tests/support/op_cases.py``). A case
becomes a one-op graph; ``op_trans`` splits it by a dim name or by value into 2 or 4 pieces on
devices 0..parts-1, and the reference interpreter must reproduce the op's outputs and input
gradients (rtol 1e-5, in float64 so that only the split is measured).
"""

from __future__ import annotations

from typing import Iterator

import pytest
import torch
from hypothesis import assume, given, note, settings
from hypothesis import strategies as st
from support.op_cases import MODEL_NAMES, ZOO, OpCase, all_op_cases, cases_by_target, check_split, single_threaded

import lightning_nnscaler as lnn
from lightning_nnscaler.ir.rules import rule_for
from lightning_nnscaler.primitives import TransformError


@pytest.fixture(scope="module")
def traced_once() -> Iterator[None]:
    """Trace and record every graph (~25 s) as setup, and run the checks on one torch thread."""
    with single_threaded():
        all_op_cases(with_zoo=True)
        yield


# Op kinds whose every call leaves nothing to split, with the reason (none: new_ones, GPT-2's 0-d mask
# template, is captured as a plain factory).
NOTHING_TO_SPLIT: dict[str, str] = {}


def _format_failure(case: OpCase, choice: str, parts: int, error: Exception) -> str:
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return f"{case!r} split by {choice!r} into {parts}: {type(error).__name__}: {first_line}"


@pytest.mark.parametrize("model", MODEL_NAMES + (ZOO,))
def test_every_allowed_split_of_every_op_is_equivalent(traced_once: None, model: str) -> None:
    """Exhaustive: all cases first seen in ``model`` x every allowed (dim | value) x parts in {2, 4}."""
    cases = [case for case in all_op_cases(with_zoo=True) if case.model == model]
    failures, checked = [], 0
    for case in cases:
        for choice, parts in case.allowed_splits():
            checked += 1
            try:
                check_split(case, choice, parts)
            except Exception as error:  # noqa: BLE001 - collect every failure, then report them all
                failures.append(_format_failure(case, choice, parts, error))
    assert cases and checked, f"{model}: no op case to check"
    assert not failures, f"{len(failures)} of {checked} splits differ from the single op:\n" + "\n".join(failures)


def test_every_op_kind_has_a_split_to_check(traced_once: None) -> None:
    grouped = cases_by_target(with_zoo=True)
    unchecked = {target for target, cases in grouped.items() if not any(case.allowed_splits() for case in cases)}
    assert unchecked == set(NOTHING_TO_SPLIT)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_random_split_is_equivalent(traced_once: None, data: st.DataObject) -> None:
    """Draw an op kind, one of its calls, a split its annotation allows and a number of parts."""
    grouped = {target: [case for case in cases if case.split_choices()] for target, cases in cases_by_target(with_zoo=True).items()}
    target = data.draw(st.sampled_from(sorted(target for target, cases in grouped.items() if cases)), label="target")
    case = data.draw(st.sampled_from(grouped[target]), label="case")
    choice = data.draw(st.sampled_from(case.split_choices()), label="split by")
    parts = data.draw(st.sampled_from([2, 4]), label="parts")
    assume(case.allows(choice, parts))
    note(f"{case!r}, split by {choice!r} into {parts}")
    check_split(case, choice, parts)


# --- ops without an annotation ---------------------------------------------------------------------


class _Erfinv(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.erfinv(x)


@pytest.fixture
def unannotated() -> tuple[lnn.Graph, dict[str, torch.Tensor]]:
    assert rule_for("aten.erfinv.default") is None, "pick an op without a rule for this test"
    x = torch.rand(4, 6) * 1.8 - 0.9
    graph = lnn.trace(_Erfinv(), (x,))
    return graph, lnn.bind_inputs(graph, _Erfinv(), (x,))


def test_op_without_annotation_is_captured_unannotated(unannotated) -> None:
    graph, _ = unannotated
    (op,) = graph.ops
    assert op.target == "aten.erfinv.default" and op.annotation is None


def test_op_without_annotation_cannot_be_split_and_the_error_says_it_can_be_replicated(unannotated) -> None:
    graph, _ = unannotated
    with pytest.raises(TransformError, match=r"has no dimension annotation, so it can be replicated but not split by 'a'") as error:
        lnn.op_trans(graph, graph.ops[0], "a", 2)
    assert "op_trans(graph, op, 'replicate', n)" in str(error.value)
    assert "register_annotation('aten.erfinv.default')" in str(error.value)
    with pytest.raises(TransformError, match="can be replicated but not split by 'value'"):
        lnn.op_trans(graph, graph.ops[0], "value", 2)


@pytest.mark.parametrize("parts", [2, 4])
def test_op_without_annotation_can_be_replicated(unannotated, parts: int) -> None:
    graph, inputs = unannotated
    plan = graph.copy()
    pieces = lnn.op_trans(plan, plan.ops[0], "replicate", parts)
    for device, piece in enumerate(pieces):
        lnn.op_assign(plan, piece, device)
    assert [op.device for op in plan.ops] == list(range(parts))
    lnn.assert_equivalent(graph, plan, inputs)
