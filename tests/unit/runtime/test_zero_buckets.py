"""ZeRO stages 1 and 3 reduce and gather in buckets: one collective per bucket, chunks as per box.

Each scenario runs on in-memory thread ranks. The reference is the per-box reducer ZeRO had before
buckets: every box's padded flat gradient reduce-scattered on its own, every box all-gathered from
its chunks on its own. Bucketing must give every rank the same chunks, the same chunk gradients bit
for bit, and the same rebuilt boxes, with one collective per bucket instead of one per box.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from lightning_nnscaler.runtime import run_ranks
from lightning_nnscaler.runtime.reducer import GradientReducer

pytestmark = pytest.mark.timeout(60)

SHAPES = {"wa": (5, 7), "wb": (7,), "pair": (3, 3), "wide": (4, 6), "half": (9,)}
"""Odd sizes, so most boxes' last chunk is padded."""


def boxes(rank: int, world_size: int) -> list[tuple[torch.nn.Parameter, tuple[int, ...]]]:
    """Replicated boxes, the same values on every rank: some over everyone, ``pair`` over a pair of
    ranks (at 4 ranks), ``half`` in float32 among float64 ones (a bucket per dtype)."""
    generator = torch.Generator().manual_seed(5)
    everyone = tuple(range(world_size))
    pair = everyone if world_size == 2 else (rank - rank % 2, rank - rank % 2 + 1)
    made = []
    for name, shape in SHAPES.items():
        dtype = torch.float32 if name == "half" else torch.float64
        made.append((torch.nn.Parameter(torch.randn(shape, dtype=dtype, generator=generator)), pair if name == "pair" else everyone))
    return made


class Counting:
    """A communicator that counts the collectives it runs, by kind."""

    def __init__(self, communicator) -> None:
        self.inner, self.calls = communicator, Counter()
        self.rank, self.world_size = communicator.rank, communicator.world_size

    def __getattr__(self, name):
        method = getattr(self.inner, name)
        if name in ("reduce_scatter", "all_gather"):
            def counted(*args, **kwargs):
                self.calls[name] += 1
                return method(*args, **kwargs)
            return counted
        return method


def local_gradients(rank: int, replicated) -> None:
    """A different gradient on every rank."""
    generator = torch.Generator().manual_seed(100 + rank)
    for box, _ in replicated:
        box.grad = torch.randn(box.shape, dtype=box.dtype, generator=generator)


def per_box_reference(comm, replicated) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each box's chunk gradient and its full summed gradient, one collective per box (the old reducer)."""
    chunks, full = [], []
    for box, ranks in replicated:
        size = math.ceil(box.numel() / len(ranks))
        flat = torch.nn.functional.pad(box.grad.reshape(-1), (0, size * len(ranks) - box.numel()))
        chunks.append(comm.reduce_scatter(flat, 0, ranks))
        full.append(comm.all_gather(chunks[-1], 0, ranks)[: box.numel()].reshape(box.shape))
    return chunks, full


def zero_step(zero_stage: int, bucket_bytes: int | None):
    def program(comm):
        replicated = boxes(comm.rank, comm.world_size)
        comm.create_groups(sorted({ranks for _, ranks in replicated}))
        counting = Counting(comm)
        originals = [box.detach().clone() for box, _ in replicated]
        reducer = GradientReducer(replicated, counting, comm.rank, zero_stage=zero_stage, bucket_bytes=bucket_bytes)
        if zero_stage == 3:  # the program's GATHER of every bucket before the forward
            reducer.gather_boxes()
        rebuilt_before = [box.detach().clone() for box, _ in replicated]
        local_gradients(comm.rank, replicated)
        expected_chunks, expected_full = per_box_reference(comm, replicated)
        counting.calls.clear()
        reducer.before_backward()
        reducer.after_backward()
        reduce_scatters = counting.calls["reduce_scatter"]
        chunk_gradients = [owned.chunk.grad.clone() for owned in reducer.owned]
        gathered = reducer.gathered_gradients()
        with torch.no_grad():
            for owned in reducer.owned:
                owned.chunk.add_(1.0)  # an optimizer step
        counting.calls.clear()
        reducer.after_optimizer_step()
        if zero_stage == 3:  # the program's GATHER of every bucket before the forward
            reducer.gather_boxes()
        return {
            "reduce_scatters": reduce_scatters,
            "gathers": counting.calls["all_gather"],
            "chunk_gradients": chunk_gradients,
            "expected_chunks": expected_chunks,
            "gathered": [gathered[id(box)] for box, _ in replicated],
            "expected_full": expected_full,
            "originals": originals,
            "rebuilt_before": rebuilt_before,
            "rebuilt_after": [box.detach().clone() for box, _ in replicated],
        }

    return program


@pytest.mark.parametrize("zero_stage", [1, 3])
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("bucket_bytes", [None, 64])
def test_bucketed_zero_gives_every_rank_the_per_box_chunks_gradients_and_boxes(zero_stage, world_size, bucket_bytes):
    for rank, result in enumerate(run_ranks(world_size, zero_step(zero_stage, bucket_bytes), timeout=20)):
        for actual, expected in zip(result["chunk_gradients"], result["expected_chunks"], strict=True):
            assert torch.equal(actual, expected), f"rank {rank}"
        for actual, expected in zip(result["gathered"], result["expected_full"], strict=True):
            assert torch.equal(actual, expected), f"rank {rank}"
        for before, original, after in zip(result["rebuilt_before"], result["originals"], result["rebuilt_after"], strict=True):
            assert torch.equal(before, original)  # stage 3 gathers the boxes back exactly
            assert torch.equal(after, original + 1.0)  # every chunk's update reaches the whole box


@pytest.mark.parametrize("world_size", [2, 4])
def test_zero_runs_one_collective_per_bucket_not_per_box(world_size):
    """Default buckets: one per (ranks tuple, dtype): everyone's float64 boxes, the pair's, everyone's float32 one."""
    results = run_ranks(world_size, zero_step(1, None), timeout=20)
    buckets = 3 if world_size == 4 else 2  # at 2 ranks the pair is everyone
    for result in results:
        assert result["reduce_scatters"] == buckets < len(SHAPES)
        assert result["gathers"] == buckets


def test_small_buckets_cut_at_the_byte_limit():
    """64-byte buckets: a box of more than 64 bytes closes its bucket."""
    results = run_ranks(2, zero_step(3, 64), timeout=20)
    assert all(result["reduce_scatters"] == len(SHAPES) - 1 for result in results)  # wb (56 B) shares with pair
