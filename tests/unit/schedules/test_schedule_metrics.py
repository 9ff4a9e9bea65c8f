"""Bubble fractions from the symbolic execution against the formulas, and peak stashed microbatches.

Duration model: F = 1, B = 2 (input + weight gradients, 1 each), W = 1 when split, communication free.
"""

from __future__ import annotations

import pytest

from lightning_nnscaler.schedules import (
    Durations,
    bubble_fraction,
    gpipe,
    interleaved,
    lower,
    one_f_one_b,
    peak_in_flight,
    theoretical_bubble_fraction,
    zb1,
)

CASES = [(ranks, microbatches) for ranks in (2, 4) for microbatches in sorted({ranks, 2 * ranks, 8})]


@pytest.mark.parametrize(("ranks", "microbatches"), CASES)
def test_gpipe_and_one_f_one_b_bubble_is_the_formula(ranks: int, microbatches: int) -> None:
    expected = theoretical_bubble_fraction(ranks, microbatches)
    assert expected == pytest.approx((ranks - 1) / (microbatches + ranks - 1))
    assert bubble_fraction(gpipe(ranks, microbatches)) == pytest.approx(expected)
    assert bubble_fraction(one_f_one_b(ranks, microbatches)) == pytest.approx(expected)
    assert bubble_fraction(lower(one_f_one_b(ranks, microbatches))) == pytest.approx(expected)


@pytest.mark.parametrize("durations", [Durations(forward=1, backward_input=0.5, backward_weight=0.5), Durations(forward=2)])
def test_one_f_one_b_formula_holds_for_other_forward_backward_ratios(durations: Durations) -> None:
    assert bubble_fraction(one_f_one_b(4, 8), durations) == pytest.approx(theoretical_bubble_fraction(4, 8))


@pytest.mark.parametrize(("ranks", "microbatches"), CASES)
def test_interleaved_bubble_shrinks_by_the_virtual_stages(ranks: int, microbatches: int) -> None:
    assert bubble_fraction(interleaved(ranks, 2, microbatches)) == pytest.approx(theoretical_bubble_fraction(ranks, microbatches, 2))


@pytest.mark.parametrize(("ranks", "microbatches"), CASES)
def test_zb1_bubble_is_below_one_f_one_b(ranks: int, microbatches: int) -> None:
    # Qi et al. 2023: ZB-H1 idles (p - 1)(F + B - W) = p - 1 units per rank against 1F1B's (p - 1)(F + B + W).
    zero_bubble = bubble_fraction(zb1(ranks, microbatches))
    assert zero_bubble < bubble_fraction(one_f_one_b(ranks, microbatches))
    assert zero_bubble == pytest.approx((ranks - 1) / (3 * microbatches + ranks - 1))


@pytest.mark.parametrize(("ranks", "microbatches"), CASES)
def test_peak_in_flight(ranks: int, microbatches: int) -> None:
    assert peak_in_flight(one_f_one_b(ranks, microbatches)) == [min(ranks - rank, microbatches) for rank in range(ranks)]
    assert max(peak_in_flight(zb1(ranks, microbatches))) == max(peak_in_flight(one_f_one_b(ranks, microbatches)))
    assert peak_in_flight(gpipe(ranks, microbatches)) == [microbatches] * ranks


def test_communication_time_lengthens_the_step() -> None:
    assert bubble_fraction(lower(one_f_one_b(2, 4)), Durations(communication=1)) > bubble_fraction(one_f_one_b(2, 4))
