"""3F1B (nnScaler, Lin et al. OSDI 2024, §6: AlphaFold2's recycling): extra no-grad forwards fill the bubbles.

A model with recycling runs ``r - 1`` forward passes under ``torch.no_grad()``, each feeding the next,
then one forward with gradients and its backward. As a pipeline of ``p`` ranks it is a chain of
``r × p`` stages — pass ``k``'s stage ``s`` is stage ``k p + s``, on rank ``s`` — whose first
``(r - 1) p`` stages are forward only: nothing stashed, no backward, no gradient sent back.

The order is Megatron's interleaved 1F1B over ``r`` chunks per rank, with the backwards of the
recycling chunks left out: where interleaving would run a recycling pass's backward, the rank runs
the next forward instead, so in the steady state each rank runs ``r`` forwards per backward (3F1B at
``r = 3``) and the recycling passes of later microbatches fill the bubbles of earlier ones' gradient
pass. Leaving out actions (with the messages only they exchange) keeps a schedule deadlock-free and
its messages in order, so the result is as valid as interleaved 1F1B; ``validate`` checks it anyway.
"""

from __future__ import annotations

from lightning_nnscaler.schedules.actions import Kind, Schedule, require_positive
from lightning_nnscaler.schedules.interleaved import interleaved


def three_f_one_b(ranks: int, microbatches: int, recycles: int = 3) -> Schedule:
    """Compute-only 3F1B schedule of ``recycles`` passes (the last with gradients) over ``ranks`` ranks.

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
