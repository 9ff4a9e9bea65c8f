"""Each lowering pass alone, on literal text (DESIGN.md §9), and the buckets every consumer shares."""

from __future__ import annotations

import pytest

from lightning_nnscaler.program import (
    Action, Bucket, Program, ReplicatedBox, SegmentPeers, compute_only, gradient_buckets, lower_step, with_loss, with_messages,
    with_optimizer, with_reductions,
)


def parsed(*ranks: str) -> list[list[Action]]:
    return [[Action.parse(text) for text in rank.split()] for rank in ranks]


def text(program: Program) -> list[str]:
    return [", ".join(rank) for rank in program.as_text()]


ONE_F_ONE_B = parsed("0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1")
PIPELINE_PEERS = {
    (0, (0, 0)): SegmentPeers(outputs=(1,), gradient_outputs=(1,)), (0, (0, 1)): SegmentPeers(outputs=(1,), gradient_outputs=(1,)),
    (1, (1, 0)): SegmentPeers(inputs=(0,), gradient_inputs=(0,)), (1, (1, 1)): SegmentPeers(inputs=(0,), gradient_inputs=(0,)),
}


def peers(rank: int, segment: tuple[int, int]) -> SegmentPeers:
    return PIPELINE_PEERS.get((rank, segment), SegmentPeers())


def test_messages_go_around_the_compute_that_posts_them() -> None:
    lowered = with_messages(compute_only(ONE_F_ONE_B), peers)
    assert text(lowered) == [
        "0F0, 0SEND_F0->1, 0F1, 0SEND_F1->1, 0RECV_B0<-1, 0B0, 0RECV_B1<-1, 0B1",
        "1RECV_F0<-0, 1F0, 1B0, 1SEND_B0->0, 1RECV_F1<-0, 1F1, 1B1, 1SEND_B1->0",
    ]


def test_a_segment_with_two_peers_receives_from_each_once_in_first_message_order() -> None:
    lowered = with_messages(compute_only(parsed("2F0 2B0")), lambda rank, segment: SegmentPeers(inputs=(1, 0), gradient_inputs=(0,)))
    assert text(lowered) == ["2RECV_F0<-1, 2RECV_F0<-0, 2F0, 2B0, 2SEND_B0->0"]


def test_buckets_are_reduced_after_the_last_action_that_accumulates_gradients() -> None:
    buckets = [(Bucket((0, 1), ("1", "0"), 8), Bucket((0, 1), ("2",), 4))]
    assert text(with_reductions(compute_only(parsed("0F0 0F1 0B0 0B1"), buckets))) == ["0F0, 0F1, 0B0, 0B1, REDUCE b0, REDUCE b1"]
    split = compute_only(parsed("0F0 0B0 0F1 0W0 0B1 0W1"), buckets)  # zero-bubble: W accumulates, after the last B
    assert text(with_reductions(split)) == ["0F0, 0B0, 0F1, 0W0, 0B1, 0W1, REDUCE b0, REDUCE b1"]
    assert text(with_reductions(compute_only(parsed("0F0 0B0")))) == ["0F0, 0B0"]  # nothing replicated, nothing to sum


def test_the_loss_overlaps_backward_unless_the_plan_pipelines() -> None:
    program = with_messages(compute_only(ONE_F_ONE_B), peers)
    assert text(with_loss(compute_only(parsed("0F0 0B0")), overlapped=True)) == ["0F0, LOSS, 0B0"]
    assert text(with_loss(program, overlapped=False))[1].endswith("1B1, 1SEND_B1->0, LOSS")


def test_zero_gathers_around_the_optimizer_step() -> None:
    buckets = [(Bucket((0, 1), ("0",), 8), Bucket((0, 1), ("1",), 8))]
    plain = compute_only(parsed("0F0 0B0"), buckets)
    assert text(with_optimizer(plain)) == ["0F0, 0B0, STEP"]
    assert text(with_optimizer(compute_only(parsed("0F0 0B0"), buckets, zero_stage=1))) == ["0F0, 0B0, STEP, GATHER b0, GATHER b1"]
    assert text(with_optimizer(compute_only(parsed("0F0 0B0"), buckets, zero_stage=3))) == [
        "GATHER b0, GATHER b1, 0F0, 0B0, STEP, FREE b0, FREE b1"]


def test_the_whole_lowering_of_a_zero3_data_parallel_rank() -> None:
    buckets = [(Bucket((0, 1), ("0",), 8),)] * 2
    program = lower_step(parsed("0F0 0B0", "0F0 0B0"), lambda rank, segment: SegmentPeers(), buckets, pipelined=False, zero_stage=3)
    assert text(program) == ["GATHER b0, 0F0, LOSS, 0B0, REDUCE b0, STEP, FREE b0"] * 2
    assert Program.from_text(program.as_text(), program.buckets, zero_stage=3) == program


def test_a_program_refuses_a_bucket_its_rank_does_not_have() -> None:
    with pytest.raises(ValueError, match="rank 0: REDUCE b1 names a bucket, but the rank has 1 buckets"):
        Program.from_text([["0F0", "0B0", "REDUCE b1"]], [(Bucket((0, 1), ("0",), 8),)])
    with pytest.raises(ValueError, match="compute_only\\(\\) takes F, B and W actions; rank 0 has LOSS"):
        compute_only(parsed("0F0 LOSS"))


def boxes(*sizes: int, ranks: tuple[int, ...] = (0, 1), dtype: str = "float32") -> list[ReplicatedBox]:
    return [ReplicatedBox(str(index), ranks, size, 4, dtype) for index, size in enumerate(sizes)]


def test_buckets_are_cut_in_reverse_registration_order_once_they_reach_the_size() -> None:
    buckets = gradient_buckets(boxes(10, 10, 10, 10), bucket_bytes=80)
    assert [bucket.vars for bucket in buckets] == [("3", "2"), ("1", "0")]
    assert [bucket.nbytes for bucket in buckets] == [80, 80]
    assert [bucket.vars for bucket in gradient_buckets(boxes(10, 10, 10), bucket_bytes=1)] == [("2",), ("1",), ("0",)]


def test_a_dtype_change_starts_a_new_bucket_and_zero_pads_each_box_to_its_ranks() -> None:
    mixed = boxes(3, 3) + [ReplicatedBox("2", (0, 1), 3, 2, "bfloat16")]
    assert [bucket.vars for bucket in gradient_buckets(mixed)] == [("2",), ("1", "0")]
    assert [bucket.nbytes for bucket in gradient_buckets(boxes(3, 3), zero=True)] == [32]  # 2 × 4 elements of 4 bytes


def test_buckets_of_several_rank_tuples_go_in_the_order_their_gradients_complete() -> None:
    pair, world = (0, 1), (0, 1, 2, 3)
    registered = [ReplicatedBox("0", world, 10, 4), ReplicatedBox("1", pair, 10, 4), ReplicatedBox("2", world, 10, 4),
                  ReplicatedBox("3", pair, 10, 4)]
    buckets = gradient_buckets(registered, bucket_bytes=1)
    assert [(bucket.ranks, bucket.vars) for bucket in buckets] == [(pair, ("3",)), (world, ("2",)), (pair, ("1",)), (world, ("0",))]
    with pytest.raises(ValueError, match="listed twice"):
        gradient_buckets(registered + registered[:1])
