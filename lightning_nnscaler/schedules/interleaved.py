"""Interleaved 1F1B (Narayanan et al. 2021, §2.2; Megatron-LM ``forward_backward_pipelining_with_interleaving``).

Each of the p ranks holds v model chunks (virtual stages): rank r holds stages r, r + p, ..., r + (v-1)p,
so every microbatch visits every rank v times. Microbatches run in groups of p: the k-th forward of
a rank is chunk ``(k // p) % v`` of microbatch ``(k // (p v)) p + k % p``; backwards walk the chunks in
reverse. Warm-up is Megatron's ``(p - r - 1) * 2 + (v - 1) * p`` forwards (all of them when m = p).
The bubble fraction falls to (p - 1) / (v m + p - 1).
"""

from __future__ import annotations

import functools

from lightning_nnscaler.schedules.actions import B, F, Action, Kind, Schedule, require_positive


def interleaved(ranks: int, virtual_stages: int, microbatches: int) -> Schedule:
    """Compute-only interleaved 1F1B schedule over ``ranks * virtual_stages`` stages.

    Raises:
        ValueError: when ``microbatches`` is not a multiple of ``ranks`` (Megatron requires it, since
            microbatches run in groups of one per rank).
    """
    require_positive(ranks=ranks, virtual_stages=virtual_stages, microbatches=microbatches)
    if microbatches % ranks:
        raise ValueError(
            f"interleaved 1F1B needs microbatches divisible by ranks (Megatron runs them in groups of one per rank): "
            f"got microbatches={microbatches}, ranks={ranks}; use microbatches={-(-microbatches // ranks) * ranks}"
        )
    total = microbatches * virtual_stages
    actions = []
    for rank in range(ranks):
        if microbatches == ranks:
            warmup = total
        else:
            warmup = min((ranks - rank - 1) * 2 + (virtual_stages - 1) * ranks, total)
        action = functools.partial(_virtual_action, ranks, virtual_stages, rank)
        rank_actions = [action(index, F) for index in range(warmup)]
        for index in range(total - warmup):  # steady: one forward, one backward
            rank_actions += [action(warmup + index, F), action(index, B)]
        rank_actions += [action(index, B) for index in range(total - warmup, total)]
        actions.append(rank_actions)
    stage_ranks = tuple(stage % ranks for stage in range(ranks * virtual_stages))
    return Schedule(actions, stage_ranks, microbatches)


def _virtual_action(ranks: int, virtual_stages: int, rank: int, index: int, kind: Kind) -> Action:
    """The ``index``-th forward (or backward) of ``rank``: Megatron's ``get_model_chunk_id`` and microbatch id."""
    chunk = (index // ranks) % virtual_stages
    if kind is B:
        chunk = virtual_stages - 1 - chunk
    microbatch = (index // (ranks * virtual_stages)) * ranks + index % ranks
    return Action(chunk * ranks + rank, microbatch, kind)
