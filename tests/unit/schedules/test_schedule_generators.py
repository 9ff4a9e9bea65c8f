"""Generators give the literal per-rank orders of their sources, and every one validates, lowered or not."""

from __future__ import annotations

import pytest

from lightning_nnscaler.schedules import gpipe, interleaved, lower, one_f_one_b, validate, zb1


def test_gpipe_two_stages() -> None:
    assert gpipe(2, 2).as_text() == [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1F1", "1B0", "1B1"]]


def test_one_f_one_b_matches_megatron_and_torch_pipelining() -> None:
    # Megatron: p - 1 - r warm-up forwards, then forward/backward pairs, then the remaining backwards.
    # torch.distributed.pipelining's Schedule1F1B yields the same order per rank.
    assert one_f_one_b(2, 4).as_text() == [
        ["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"],
        ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3"],
    ]


def test_one_f_one_b_with_fewer_microbatches_than_stages() -> None:
    assert one_f_one_b(4, 2).as_text()[0] == ["0F0", "0F1", "0B0", "0B1"]


def test_interleaved_matches_megatron_chunk_order() -> None:
    # Rank 0 holds stages 0 and 2. Warm-up (p - r - 1) * 2 + (v - 1) * p = 4 forwards on rank 0, 2 on rank 1;
    # microbatches go in groups of p per chunk; backwards visit the chunks in reverse.
    assert interleaved(2, 2, 4).as_text() == [
        ["0F0", "0F1", "2F0", "2F1", "0F2", "2B0", "0F3", "2B1", "2F2", "0B0", "2F3", "0B1", "2B2", "2B3", "0B2", "0B3"],
        ["1F0", "1F1", "3F0", "3B0", "3F1", "3B1", "1F2", "1B0", "1F3", "1B1", "3F2", "3B2", "3F3", "3B3", "1B2", "1B3"],
    ]
    assert interleaved(2, 2, 4).stage_ranks == (0, 1, 0, 1)


def test_interleaved_requires_microbatches_divisible_by_ranks() -> None:
    with pytest.raises(ValueError, match="divisible by ranks.*microbatches=6, ranks=4; use microbatches=8"):
        interleaved(4, 2, 6)


def test_zb1_defers_weight_gradients_by_rank() -> None:
    # Rank r's W trails its B by r microbatches; the deferred W's fill the cool-down.
    assert zb1(2, 3).as_text() == [
        ["0F0", "0F1", "0B0", "0W0", "0F2", "0B1", "0W1", "0B2", "0W2"],
        ["1F0", "1B0", "1F1", "1B1", "1W0", "1F2", "1B2", "1W1", "1W2"],
    ]


@pytest.mark.parametrize("generator", [gpipe, one_f_one_b, zb1])
@pytest.mark.parametrize("stages", [0, -1])
def test_generators_reject_non_positive_counts(generator, stages: int) -> None:
    with pytest.raises(ValueError, match="stages must be a positive integer"):
        generator(stages, 4)


CASES = [(ranks, microbatches) for ranks in (2, 4) for microbatches in sorted({ranks, 2 * ranks, 8})]
GENERATORS = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": lambda ranks, microbatches: interleaved(ranks, 2, microbatches),
    "zb1": zb1,
}


@pytest.mark.parametrize(("ranks", "microbatches"), CASES)
@pytest.mark.parametrize("name", GENERATORS)
def test_every_generator_validates_compute_only_and_lowered(name: str, ranks: int, microbatches: int) -> None:
    schedule = GENERATORS[name](ranks, microbatches)
    assert schedule.world_size == ranks
    validate(schedule)
    validate(lower(schedule))


def test_interleaved_on_one_rank_needs_no_communication() -> None:
    schedule = interleaved(1, 2, 2)
    assert lower(schedule) == schedule
    validate(schedule)
