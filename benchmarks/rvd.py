"""RVD search vs naive point-to-point vs torch DTensor ``redistribute``: bytes on the wire per transition.

    python benchmarks/rvd.py

Each row is one layout transition of a float32 tensor. "ours" is the path ``search`` returns
(default ``AlphaBeta`` cost) and its volume: bytes sent over the wire, summed over devices. "P2P"
is the naive plan: every target piece fetched piece-wise from the first source holder of each
overlapping box, data a device already holds excluded. "DTensor" is the plan torch's own
redistribute planner (``_gen_transform_infos_non_cached``, the default greedy planner that
``DTensor.redistribute`` runs) makes for the same placements on a ``DeviceMesh`` over a fake
process group (no communication happens); "DTensor min-cost" is its opt-in graph planner
(``use_min_cost_redistribution_plan``). Both are priced with the same collective volumes as ours:
all-reduce 2(p-1)/p·n, all-gather (p-1)/p·n (n = output), reduce-scatter and all-to-all
(p-1)/p·n per device. DTensor cannot move a tensor between meshes, so rows between groups print
"n/a". Search time: median CPU time of 5 uncached searches, every helper table cleared too.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from lightning_nnscaler.materialize import Layout, clear_search_cache, p2p_path, search

DTYPE_BYTES = 4
ONE_D = (1 << 22,)  # 16 MiB
TWO_D = (2048, 2048)  # 16 MiB
MIB = 1 << 20


@dataclass(frozen=True)
class Row:
    shape: tuple[int, ...]
    source: Layout
    target: Layout
    mesh_shape: tuple[int, ...] | None = None  # DTensor rows: the mesh and placements the layouts come from
    source_placements: tuple[Placement, ...] = ()
    target_placements: tuple[Placement, ...] = ()


def layout_of(mesh_shape: tuple[int, ...], placements: tuple[Placement, ...], rank: int) -> Layout:
    """Our layout for DTensor placements on ``arange(prod(mesh_shape)).reshape(mesh_shape)``.

    Mesh axes go to R (Replicate), V (Partial) or D_k (Shard(k)), each group in mesh order, which is
    DTensor's default shard order (the first mesh axis sharding a dim cuts it outermost).
    """
    mesh = torch.arange(math.prod(mesh_shape)).reshape(mesh_shape)
    replica_axes = [axis for axis, placement in enumerate(placements) if placement.is_replicate()]
    value_axes = [axis for axis, placement in enumerate(placements) if placement.is_partial()]
    dim_axes = [[axis for axis, placement in enumerate(placements) if placement.is_shard(dim)] for dim in range(rank)]
    order = replica_axes + value_axes + [axis for axes in dim_axes for axis in axes]
    size = lambda axes: math.prod(mesh_shape[axis] for axis in axes)  # noqa: E731
    devices = tuple(mesh.permute(order).reshape(-1).tolist())
    return Layout(size(replica_axes), size(value_axes), tuple(size(axes) for axes in dim_axes), devices)


def dtensor_row(shape: tuple[int, ...], mesh_shape: tuple[int, ...], source: tuple, target: tuple) -> Row:
    rank = len(shape)
    source_layout, target_layout = layout_of(mesh_shape, source, rank), layout_of(mesh_shape, target, rank)
    return Row(shape, source_layout, target_layout, mesh_shape, source, target)


def layout_row(shape: tuple[int, ...], source: str, target: str) -> Row:
    return Row(shape, Layout.parse(source), Layout.parse(target))


P, R, S0, S1 = Partial(), Replicate(), Shard(0), Shard(1)
ROWS = [
    dtensor_row(ONE_D, (4,), (P,), (R,)),
    dtensor_row(ONE_D, (4,), (S0,), (R,)),
    dtensor_row(ONE_D, (8,), (P,), (S0,)),
    dtensor_row(ONE_D, (8,), (R,), (S0,)),
    dtensor_row(ONE_D, (16,), (P,), (S0,)),
    dtensor_row(ONE_D, (2, 4), (S0, S0), (R, S0)),
    dtensor_row(TWO_D, (8,), (S0,), (S1,)),
    dtensor_row(TWO_D, (32,), (S0,), (S1,)),
    dtensor_row(TWO_D, (2, 4), (R, P), (R, R)),
    dtensor_row(TWO_D, (2, 4), (S0, S0), (R, S0)),
    dtensor_row(TWO_D, (2, 4), (S0, S1), (S1, S0)),
    dtensor_row(TWO_D, (2, 4), (R, S0), (S0, R)),
    dtensor_row(TWO_D, (4, 2), (S0, P), (S0, R)),
    dtensor_row(TWO_D, (4, 4), (P, S0), (R, S1)),
    dtensor_row(TWO_D, (2, 8), (P, P), (R, S0)),
    dtensor_row(TWO_D, (2, 2, 2), (P, P, P), (R, S0, S1)),
    dtensor_row(TWO_D, (4, 8), (S0, S1), (S1, S0)),
    dtensor_row(TWO_D, (4, 8), (P, S1), (S0, S1)),
    layout_row(ONE_D, "R4V1D(1)@[0..3]", "R2V1D(1)@[4,5]"),
    layout_row(ONE_D, "R1V1D(4)@[0..3]", "R1V1D(2)@[4,5]"),
    layout_row((3 * MIB + 1,), "R1V1D(3)@[0..2]", "R1V1D(4)@[0..3]"),  # uneven chunks
    layout_row(TWO_D, "R1V1D(8,1)@[0..7]", "R1V1D(1,4)@[8..11]"),
    layout_row(TWO_D, "R1V2D(4,1)@[0..7]", "R4V1D(1,1)@[8..11]"),
    layout_row(TWO_D, "R2V1D(1,4)@[0..7]", "R1V1D(1,4)@[8..11]"),
    layout_row(TWO_D, "R1V1D(16,1)@[0..15]", "R2V1D(8,1)@[16..31]"),
    layout_row(TWO_D, "R1V1D(1,8)@[0..7]", "R8V1D(1,1)@[8..15]"),
]


def dtensor_volume(row: Row, min_cost: bool = False) -> tuple[int, str] | None:
    """Bytes on the wire of DTensor's own redistribute plan, and its steps; None where it cannot say.

    ``min_cost`` asks for DTensor's opt-in graph planner (``use_min_cost_redistribution_plan``)
    instead of the default greedy one.
    """
    if row.mesh_shape is None:
        return None
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._redistribute import _gen_transform_infos_non_cached

    devices = math.prod(row.mesh_shape)
    mesh = DeviceMesh("cpu", torch.arange(devices).reshape(row.mesh_shape))
    meta = TensorMeta(torch.Size(row.shape), torch.empty(row.shape, device="meta").stride(), torch.float32)
    source = DTensorSpec(mesh, row.source_placements, tensor_meta=meta)
    target = DTensorSpec(mesh, row.target_placements, tensor_meta=meta)
    placements, volume, names = list(row.source_placements), 0.0, []
    for info in _gen_transform_infos_non_cached(source, target, use_graph_based_transform=min_cost):
        group = row.mesh_shape[info.mesh_dim]
        shards = math.prod(size for size, placement in zip(row.mesh_shape, placements) if placement.is_shard())
        local = math.prod(row.shape) * DTYPE_BYTES / shards  # bytes of one device's piece before the step
        before, after = info.src_dst_placements
        if before.is_partial() and after.is_replicate():
            name, per_device = "all-reduce", 2 * (group - 1) / group * local
        elif before.is_partial() and after.is_shard():
            name, per_device = "reduce-scatter", (group - 1) / group * local
        elif before.is_shard() and after.is_replicate():
            name, per_device = "all-gather", (group - 1) * local
        elif before.is_shard() and after.is_shard():
            name, per_device = "all-to-all", (group - 1) / group * local
        else:
            name, per_device = "local", 0.0
        volume += per_device * devices
        names.append(name)
        placements[info.mesh_dim] = after
    return round(volume), ", ".join(names) or "no-op"


def timed_search(row: Row) -> float:
    """Median CPU seconds of an uncached search (the result cache and every helper table cleared).

    The garbage collector is off while timing, as in ``timeit``: with torch imported a full
    collection walks ~10^5 objects and would be charged to whichever call triggers it.
    """
    timings = []
    for _ in range(5):
        clear_search_cache()
        gc.disable()
        started = time.process_time()
        search(row.shape, DTYPE_BYTES, row.source, row.target)
        timings.append(time.process_time() - started)
        gc.enable()
    return statistics.median(timings)


def ratio(ours: int, theirs: int) -> str:
    return f"{ours / theirs:.2f}" if theirs else "-"


def transition_text(row: Row) -> str:
    """DTensor rows in placements (``mesh 2×4: S0,S0 → R,S0``), the others in R·V·D text."""
    if row.mesh_shape is None:
        return f"{row.source} → {row.target}"
    names = lambda placements: ",".join(  # noqa: E731
        "P" if placement.is_partial() else "R" if placement.is_replicate() else f"S{placement.dim}"
        for placement in placements
    )
    mesh = "×".join(map(str, row.mesh_shape))
    return f"mesh {mesh}: {names(row.source_placements)} → {names(row.target_placements)}"


def main() -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=32)
    header = [
        "#", "transition", "shape", "ours (steps)", "ours MiB", "P2P MiB", "DTensor MiB", "DTensor min-cost MiB",
        "ours/P2P", "ours/DTensor", "ours/min-cost", "DTensor plan", "search ms",
    ]  # fmt: skip
    lines, times = [header], []
    for number, row in enumerate(ROWS, 1):
        path = search(row.shape, DTYPE_BYTES, row.source, row.target)
        naive = p2p_path(row.shape, DTYPE_BYTES, row.source, row.target)
        peer, best_peer = dtensor_volume(row), dtensor_volume(row, min_cost=True)
        times.append(timed_search(row))
        lines.append([
            str(number),
            transition_text(row),
            "×".join(map(str, row.shape)),
            str(path),
            f"{path.volume / MIB:.2f}",
            f"{naive.volume / MIB:.2f}",
            "n/a" if peer is None else f"{peer[0] / MIB:.2f}",
            "n/a" if best_peer is None else f"{best_peer[0] / MIB:.2f}",
            ratio(path.volume, naive.volume),
            "n/a" if peer is None else ratio(path.volume, peer[0]),
            "n/a" if best_peer is None else ratio(path.volume, best_peer[0]),
            "n/a" if peer is None else peer[1],
            f"{times[-1] * 1e3:.2f}",
        ])  # fmt: skip
    widths = [max(len(line[column]) for line in lines) for column in range(len(header))]
    for index, line in enumerate(lines):
        print("| " + " | ".join(cell.ljust(width) for cell, width in zip(line, widths)) + " |")
        if index == 0:
            print("|-" + "-|-".join("-" * width for width in widths) + "-|")
    median, worst = statistics.median(times) * 1e3, max(times) * 1e3
    print(f"\nsearch time per uncached case: median {median:.2f} ms, max {worst:.2f} ms")
    print("\nrows as R·V·D layouts (devices in canonical order):")
    for number, row in enumerate(ROWS, 1):
        print(f"  {number:2}. {row.source} → {row.target}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
