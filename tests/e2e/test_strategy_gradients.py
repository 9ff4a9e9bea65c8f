"""Data parallelism with one gradient buffer and the optimizer step overlapped with the gradient sums
(2 gloo ranks, GPT reference, AdamW over two param groups with a warm-up LR schedule).

- The replicated gradients are views of the buckets' one buffer each (storage identity), the
  buckets hold exactly one copy of them, and training equals DDP's at rtol 1e-5 for 20 steps, with
  and without gradient accumulation.
- The overlapped step (several buckets, each stepped as its sum arrives) leaves weights bit-identical
  to the step after all sums, after 20 steps.
- With ``gradient_clip_val`` the overlap is off (and says why) and training equals DDP's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from support.ranks import launch_ranks

from gradient_runs import SMALL_BUCKETS_MB, worker  # noqa: E402 - tests/e2e is on sys.path

STEPS = 20
OVERLAPPED = {"recipe": "dp", "bucket_cap_mb": SMALL_BUCKETS_MB}
RUNS: list[tuple[str, Any, dict[str, Any]]] = [
    ("ddp", "ddp", {"steps": STEPS}),
    ("nnscaler", OVERLAPPED, {"steps": STEPS}),
    ("ddp accumulate", "ddp", {"steps": STEPS, "accumulate": 2}),
    ("nnscaler accumulate", OVERLAPPED, {"steps": STEPS, "accumulate": 2}),
    ("nnscaler not overlapped", {**OVERLAPPED, "overlap_optimizer": False}, {"steps": STEPS}),
    ("ddp clipped", "ddp", {"steps": 5, "clip": 0.5}),
    ("nnscaler clipped", OVERLAPPED, {"steps": 5, "clip": 0.5}),
]


@pytest.fixture(scope="module")
def results() -> list[dict[str, dict[str, Any]]]:
    return launch_ranks(worker, 2, RUNS, timeout=280)


def assert_trains_like(actual: dict[str, Any], expected: dict[str, Any], label: str) -> None:
    assert len(actual["losses"]) == len(expected["losses"])
    torch.testing.assert_close(torch.tensor(actual["losses"]), torch.tensor(expected["losses"]), rtol=1e-5, atol=1e-6, msg=lambda m: f"{label} losses: {m}")
    for key, value in expected["state"].items():
        torch.testing.assert_close(actual["state"][key], value, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{label} {k}: {m}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("run", ["nnscaler", "nnscaler accumulate"])
def test_gradients_are_views_of_one_bucket_buffer_and_training_equals_ddp(results: list[dict], run: str) -> None:
    for rank, by_label in enumerate(results):
        actual = by_label[run]
        assert actual["off_reasons"] == [], f"rank {rank}: the overlap is off: {actual['off_reasons']}"
        assert actual["buckets"] > 1 and actual["all_views"], f"rank {rank}: {actual['buckets']} buckets, every gradient a view: {actual['all_views']}"
        assert actual["bucket_bytes"] == actual["gradient_bytes"]  # one copy of the gradients
        assert actual["simulated_bucket_sizes"] == actual["bucket_sizes"]  # the simulator prices the buckets bucket_cap_mb made
        assert actual["bucket_steps"] == actual["buckets"] * STEPS  # every bucket of every step stepped as its sum arrived
        assert_trains_like(actual, by_label[run.replace("nnscaler", "ddp")], f"rank {rank} {run}")


@pytest.mark.timeout(300)
def test_the_overlapped_step_is_bit_identical_to_the_step_after_every_sum(results: list[dict]) -> None:
    for rank, by_label in enumerate(results):
        overlapped, waited = by_label["nnscaler"], by_label["nnscaler not overlapped"]
        assert overlapped["bucket_steps"] > 0 and waited["bucket_steps"] == 0
        assert waited["off_reasons"] == ["overlap_optimizer=False"]
        assert overlapped["losses"] == waited["losses"]
        for key, value in waited["state"].items():
            assert torch.equal(overlapped["state"][key], value), f"rank {rank} {key} differs"


@pytest.mark.timeout(300)
def test_clipping_turns_the_overlap_off_and_training_equals_ddp(results: list[dict]) -> None:
    for rank, by_label in enumerate(results):
        clipped = by_label["nnscaler clipped"]
        assert clipped["off_reasons"] == ["gradient_clip_val"] and clipped["bucket_steps"] == 0
        assert_trains_like(clipped, by_label["ddp clipped"], f"rank {rank} clipped")
