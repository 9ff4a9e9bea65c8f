"""Evaluation and the end of a fit stay within the training peak: per rank, the peak resident memory of
``validate``, ``test``, ``predict`` (each planned forward-only over the training pieces) and of the end of the fit
(after the last step: the weights left in the module, the teardown) is at most the peak while training.

2 gloo ranks, a GPT whose weights and AdamW state dominate (``eval_peak_runs.CONFIG``), built on meta under tp and
zero3 (no rank ever holds the whole model) and eagerly under tp.
"""

from __future__ import annotations

import pytest

from support.ranks import launch_ranks

from eval_peak_runs import peak_worker  # noqa: E402

RUNS = [("tp-meta", "nnscaler_tp", "meta"), ("zero3-meta", "nnscaler_zero3", "meta"), ("tp-eager", "nnscaler_tp", "eager")]
MIB = 2**20


@pytest.fixture(scope="module")
def peaks() -> list[dict[str, dict[str, int]]]:
    """Every rank's peaks by run and phase."""
    return launch_ranks(peak_worker, 2, RUNS, timeout=600)


@pytest.mark.timeout(660)
@pytest.mark.parametrize("name", [name for name, _, _ in RUNS])
def test_evaluation_and_the_end_of_fit_stay_within_the_training_peak(peaks: list[dict[str, dict[str, int]]], name: str) -> None:
    for rank, by_run in enumerate(peaks):
        phases = by_run[name]
        print(f"{name} rank {rank} peak MiB: " + ", ".join(f"{phase} {value / MIB:.1f}" for phase, value in phases.items()))
        for phase in ("end", "validate", "test", "predict"):
            assert phases[phase] <= phases["train"], (
                f"rank {rank}: {phase} peaked at {phases[phase] / MIB:.1f} MiB, training at {phases['train'] / MIB:.1f}"
            )
