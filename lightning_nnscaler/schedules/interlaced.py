"""Interlaced pipeline (nnScaler, Lin et al. OSDI 2024, §6: mBART's large vocabulary): the embedding and
output layers run on every rank, split by vocabulary, interlaced with a 1F1B pipeline of the rest.

Stages: ``0`` is the shared input stage (the large embedding lookups), ``1 .. p`` are the pipeline
stages (stage ``s`` on rank ``s - 1``), ``p + 1`` is the shared output stage (the vocabulary
projection and the loss). A shared stage is in every rank's list and runs like a collective: every
rank runs its slice of the vocabulary at the same point.

The order: the ranks' 1F1B actions keep their places in time (unit forward, backward twice as long),
and the shared actions go in where their data is ready — the input stage's forward of microbatch
``m`` right before stage 1 needs it, the output stage's forward and backward as soon as stage ``p``
has finished its forward of ``m`` (before that stage's backward), the input stage's backward as
soon as stage 1 has finished its backward of ``m``. Every rank sees the shared actions in the same
global order, which keeps the lists deadlock-free; ``validate`` checks it.
"""

from __future__ import annotations

from lightning_nnscaler.schedules.actions import SHARED, Action, Kind, Schedule, require_positive
from lightning_nnscaler.schedules.one_f_one_b import one_f_one_b
from lightning_nnscaler.schedules.validate import execute

_FORWARD, _BACKWARD = 1.0, 2.0


def interlaced(ranks: int, microbatches: int) -> Schedule:
    """Compute-only interlaced schedule: shared stage 0, pipeline stages 1..``ranks``, shared stage ``ranks + 1``."""
    require_positive(ranks=ranks, microbatches=microbatches)
    core = one_f_one_b(ranks, microbatches)
    timeline = execute(core, lambda action: _FORWARD if action.kind is Kind.FORWARD else _BACKWARD)
    output_stage = ranks + 1
    shared: list[tuple[tuple[float, int], Action]] = []
    own: list[list[tuple[tuple[float, int], Action]]] = []
    for rank, rank_actions in enumerate(core.actions):
        own.append([])
        for index, action in enumerate(rank_actions):
            start, end = timeline.starts[rank][index], timeline.ends[rank][index]
            own[rank].append(((start, 1), Action(action.stage + 1, action.microbatch, action.kind)))
            first, last = action.stage == 0, action.stage == ranks - 1
            if first and action.kind is Kind.FORWARD:
                shared.append(((start, 0), Action(0, action.microbatch, Kind.FORWARD)))
            if last and action.kind is Kind.FORWARD:
                shared.append(((end, 0), Action(output_stage, action.microbatch, Kind.FORWARD)))
                shared.append(((end, 0), Action(output_stage, action.microbatch, Kind.BACKWARD)))
            if first and action.kind is Kind.BACKWARD:
                shared.append(((end, 0), Action(0, action.microbatch, Kind.BACKWARD)))
    ordered = []
    for rank_own in own:
        # Stable sort: a shared action goes before a rank's own action starting at the same time, and
        # shared actions keep the order they were listed in (the output stage's forward before its backward).
        merged = sorted(shared + rank_own, key=lambda entry: entry[0])
        ordered.append([action for _, action in merged])
    return Schedule(ordered, (SHARED, *range(ranks), SHARED), microbatches)
