"""3F1B (nnScaler, Lin et al. OSDI 2024, §6: AlphaFold2's recycling): a pipeline of a model that recycles.

A model with recycling runs ``r - 1`` forward passes under ``torch.no_grad()``, each feeding the next,
then one forward with gradients and its backward. As a pipeline of ``p`` ranks it is a chain of
``r × p`` stages — pass ``k``'s stage ``s`` is stage ``k p + s``, on rank ``s`` — whose first
``(r - 1) p`` stages are forward only: nothing stashed, no backward, no gradient sent back.

``three_f_one_b``: each rank runs its recycling stages over every microbatch, pass by pass, then 1F1B on
the gradient pass. With a forward costing F and a backward B, no order of these actions ends sooner: the
last rank waits ``(p - 1) F`` for its first input and rank 0 ends ``(p - 1) B`` after the last rank's last
backward, and this order leaves the last rank idle nowhere else (every rank r idles exactly 1F1B's
``(p - 1 - r)(F + B)`` besides its wait for the first input). It stashes 1F1B's ``p - r`` microbatches on
rank r, except at p = 2: there the last rank's messages to rank 0 carry both its recycling outputs and its
gradients, in the order it makes them (every recycling output first), so rank 0 runs all its gradient-pass
forwards before its backwards (GPipe's m stashed there).

``interleaved_recycling``: the paper's order, Megatron's interleaved 1F1B over ``r`` chunks per rank with the
recycling chunks' backwards left out, so that in the steady state each rank runs ``r`` forwards per
backward. It leaves holes of its own (symbolic bubble 0.245 against 0.184 at p = 4, m = 8, r = 3) and
measured slower (``benchmarks/pipeline.py --only recycling``); it stays for comparison.
"""

from __future__ import annotations

from lightning_nnscaler.schedules.actions import Action, Kind, Schedule, require_positive
from lightning_nnscaler.schedules.interleaved import interleaved


def three_f_one_b(ranks: int, microbatches: int, recycles: int = 3) -> Schedule:
    """Compute-only schedule of ``recycles`` passes (the last with gradients) over ``ranks`` ranks: each rank's
    recycling stages over all microbatches, then 1F1B on its gradient-pass stage."""
    require_positive(ranks=ranks, microbatches=microbatches, recycles=recycles)
    forward_only = (recycles - 1) * ranks
    actions = []
    for rank in range(ranks):
        gradient = forward_only + rank
        warmup = microbatches if ranks == 2 and rank == 0 else min(microbatches, ranks - 1 - rank)
        order = [Action(stage, microbatch, Kind.FORWARD) for stage in range(rank, forward_only, ranks) for microbatch in range(microbatches)]
        order += [Action(gradient, microbatch, Kind.FORWARD) for microbatch in range(warmup)]
        for microbatch in range(microbatches):
            if microbatch + warmup < microbatches:
                order.append(Action(gradient, microbatch + warmup, Kind.FORWARD))
            order.append(Action(gradient, microbatch, Kind.BACKWARD))
        actions.append(order)
    stage_ranks = [stage % ranks for stage in range(recycles * ranks)]
    return Schedule(actions, stage_ranks, microbatches, forward_only)


def interleaved_recycling(ranks: int, microbatches: int, recycles: int = 3) -> Schedule:
    """The paper's 3F1B order: interleaved 1F1B over ``recycles`` chunks per rank, the recycling chunks' backwards left out.

    Raises:
        ValueError: when ``microbatches`` is not a multiple of ``ranks`` (as for interleaved 1F1B).
    """
    require_positive(ranks=ranks, microbatches=microbatches, recycles=recycles)
    chunks = interleaved(ranks, recycles, microbatches)
    forward_only = (recycles - 1) * ranks
    kept = [
        [action for action in rank_actions if action.kind is Kind.FORWARD or action.stage >= forward_only]
        for rank_actions in chunks.actions
    ]
    return Schedule(kept, chunks.stage_ranks, microbatches, forward_only)
