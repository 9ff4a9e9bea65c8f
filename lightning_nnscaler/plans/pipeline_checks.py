"""The pipeline's checks: what ``plans.pipeline`` refuses before it places anything, each error naming the key and the fix."""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir.op import Op
from lightning_nnscaler.ir.rules.batch_norm import SYNC_MOMENTS
from lightning_nnscaler.schedules import Schedule
from lightning_nnscaler.schedules.csv_import import parse_table, read_csv


def check_microbatches_split(pieces: list[list[Op]]) -> None:
    """Refuse an op left whole by the batch split that reads a tensor the split cut into microbatches:
    each microbatch's copy would need every microbatch's rows, so no schedule could run them apart.

    Raises:
        ValueError: naming the op, its operator and the tensor.
    """
    split = {output.name for copies in pieces if len({copy.outputs[0].index for copy in copies if copy.outputs}) > 1 for output in copies[0].outputs}
    for copies in pieces:
        if len(copies) < 2 or len({tuple((piece.index, piece.value) for piece in copy.tensor_inputs) for copy in copies}) > 1:
            continue
        read = next((piece.name for piece in copies[0].tensor_inputs if piece.name in split), None)
        if read is not None:
            op = copies[0]
            fix = (
                f"Register a dimension annotation for {op.target} (lightning_nnscaler.register_annotation)" if op.annotation is None
                else f"Its annotation {op.annotation!r} keeps the batch dim of %{read} whole (^); if this call is exact per batch row, "
                f"register one that lets it split (lightning_nnscaler.register_annotation({op.target!r}))"
            )
            raise ValueError(
                f"pipeline: op {op.source_name!r} ({op.target}) cannot be split along the batch, so each microbatch would "
                f"read every microbatch's rows of %{read}; a pipeline needs every op on the batch's path to split by batch. "
                f"{fix}, or use a recipe without microbatches (dp, tp)"
            )


def refuse_sync_batch_norm(graph: Graph, schedule: str) -> None:
    """A pipeline runs a microbatch's forward before the next arrives: statistics over the whole batch cannot be had."""
    synced = [op.name for op in graph.ops if op.target == SYNC_MOMENTS]
    if synced:
        raise ValueError(
            f"{schedule}: nn.SyncBatchNorm ({', '.join(synced)}) needs statistics over the whole batch, but a pipeline "
            "runs each microbatch's forward before the next microbatch's: use nn.BatchNorm (statistics per microbatch, as "
            "torch.distributed.pipelining computes them), or a recipe without a pipeline (dp, zero1, zero3)"
        )


def check_microbatches(schedule: str, rows: int, microbatches: int, multiple_of: int = 1, *, chosen: bool = False) -> None:
    """Raise unless ``microbatches`` (``chosen`` by default, or given) is at least 1, divides a replica's
    ``rows`` and is a multiple of ``multiple_of`` (interleaved and 3f1b run microbatches in groups of
    one per pipeline rank).

    Raises:
        ValueError: naming the replica's batch size, the microbatches and the fixes: a larger batch_size,
            fewer microbatches (None picks a divisor for each batch) or ``DataLoader(drop_last=True)``
            when only the last batch is smaller.
    """
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise ValueError(f"{schedule}: microbatches must be an int >= 1, or None for the default, got {microbatches!r}")
    fits = [count for count in range(1, rows + 1) if rows % count == 0 and count % multiple_of == 0]
    if microbatches in fits:
        return
    batch = f"each replica's batch ({rows} row{'s' * (rows != 1)})"
    grouped = f" and be a multiple of the {multiple_of} pipeline ranks (microbatches divisible by ranks: one per rank in each group)" if multiple_of > 1 else ""
    last = "or DataLoader(drop_last=True) if only the last batch is smaller"
    if chosen:  # the default found no count that fits
        raise ValueError(
            f"{schedule}: {batch} cannot be cut into microbatches: they must divide it{grouped}, and no number does. "
            f"Use a larger batch_size (a multiple of {multiple_of} rows per replica), {last}"
        )
    raise ValueError(
        f"{schedule}: microbatches ({microbatches}) must divide {batch}{grouped}: {f'one of {fits}' if fits else 'no number does'}. "
        f"Use a larger batch_size (a multiple of {math.lcm(microbatches, multiple_of)} rows per replica), fewer microbatches "
        f"(or None, which picks one for each batch), {last}"
    )


def default_microbatches(rows: int, stages: int, multiple_of: int = 1) -> int:
    """The smallest divisor of ``rows`` that is at least ``stages`` and a multiple of ``multiple_of``
    (``rows`` when none is)."""
    return next((count for count in range(stages, rows + 1) if rows % count == 0 and count % multiple_of == 0), rows)


def count_recycles(graph: Graph) -> int:
    """How many passes a recycling model runs: 1 + the no-grad reads of its parameters per gradient-pass read.

    Raises:
        ValueError: when no op on the batch's path runs under ``torch.no_grad()`` (nothing recycles).
    """
    reads: dict[str, list[int]] = {}
    for op in graph.ops:
        for piece in op.tensor_inputs:
            if graph.tensors[piece.name].role == "parameter":
                counts = reads.setdefault(piece.name, [0, 0])
                counts[op.no_grad] += 1
    ratios = [no_grad / grad for grad, no_grad in reads.values() if grad and no_grad]
    if not ratios:
        raise ValueError(
            "3f1b: the model has no recycling passes (no op reading a parameter runs under torch.no_grad()); "
            "use 1f1b, or recycle as AlphaFold2 does: r - 1 passes under torch.no_grad(), then one with gradients"
        )
    return 1 + round(sum(ratios) / len(ratios))


def imported_schedule(path: str, pp: int, microbatches: int | None) -> Schedule:
    """The table at ``path`` (``schedules.csv_import``: parsed, checked, validated) for ``pp`` pipeline ranks.

    Raises:
        ValueError: naming ``schedule_csv`` when the file cannot be read, the table is malformed or has
            another number of rows or microbatches, or its stages do not split evenly over the ranks;
            ``ScheduleError`` (with the grid) when its order cannot run.
    """
    try:
        rows = read_csv(path)
    except OSError as error:
        raise ValueError(f"schedule_csv: cannot read {path!r}: {error}") from None
    order = parse_table(rows, source=f"schedule_csv {path!r}", ranks=pp, microbatches=microbatches)
    if order.stages % pp:
        raise ValueError(f"schedule_csv {path!r}: its {order.stages} stages must split evenly over its {pp} ranks (as many per rank)")
    return order


def check_stage_indices(named: Sequence[int] | None, stages: int, key: str = "recompute_stages") -> None:
    """Raises ValueError naming ``key`` (``recompute_stages``, ``coshard_stages``) when a stage is out of range or named twice."""
    if not named:
        return
    indices = list(named)
    if any(isinstance(index, bool) or not isinstance(index, int) for index in indices):
        raise ValueError(f"pipeline: {key} must be stage indices (ints), got {indices!r}")
    outside = [index for index in indices if not 0 <= index < stages]
    if outside:
        raise ValueError(
            f"pipeline: {key} {indices} names stage {', '.join(map(str, outside))}, outside the pipeline's "
            f"{stages} stages (0 to {stages - 1}; for interleaved, a stage is a pipeline rank and all its chunks)"
        )
    if len(set(indices)) != len(indices):
        raise ValueError(f"pipeline: {key} {indices} names a stage more than once; name each stage once")
