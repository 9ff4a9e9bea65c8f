"""Dependency materialization: a placed graph -> one program per rank.

For every piece an op reads, find the pieces written so far whose masks overlap it: an identical
piece on the same rank is used as is; otherwise each overlapping box is fetched (a local slice,
or a send on its producer's rank and a receive here), placed into the piece, and value parts are
added up. A value part ``k > 0`` of a whole tensor is exact zeros and needs no data. Graph inputs
(parameters, buffers, constants, user inputs) are held locally: each rank holds the bounding box
of what its ops read — one box per group of pieces that overlap or tile a box, so a rank reading
rows far apart (its heads' rows of q, k and v in a packed in_proj weight) holds only those — and
ranks holding the same parameter box form a gradient group.

Pipelined plans (ops carry a ``segment``): a rank's variables live in the function of their
segment, so pieces are looked up per segment (the prologue's and the held inputs are visible to
all). A piece produced in another segment — on this rank or another — arrives as a boundary
message (see ``program``); one produced by the prologue of another rank is received in this
rank's prologue, once.

Rank-local (``rank=r``, pipelined plans): rank ``r``'s program alone is built whole. Every op's outputs are
still recorded (any rank's piece may serve ``r``), every collective is still routed (each rank's code lists
every group), and a piece another rank reads is fetched only when ``r`` holds a piece overlapping it (else
``r`` can take no part in that transfer); of the other ranks' programs only their messages with ``r`` and
their collectives are whole. Rank ``r``'s actions, names and tags are those of the whole materialization: each comes from
the same steps, in the same order.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict

from lightning_nnscaler.ir.errors import NnScalerError
from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir.tensor import DTYPE_BYTES, IndexMask, PTensor, ValueMask, VTensor, covers_exactly
from lightning_nnscaler.ir.validate import validate_plan
from lightning_nnscaler.ir.op import PROLOGUE, Op
from lightning_nnscaler.materialize.collectives import collective_path, group_of
from lightning_nnscaler.materialize.early_sends import issue_sends_early
from lightning_nnscaler.materialize.names import VariableNames
from lightning_nnscaler.materialize.program import (
    Assemble, Collective, Compute, Fragment, GradientGroup, LocalTensor, Program, RankOutput, RankProgram, Recv, Segment, Send, box_of,
)
from lightning_nnscaler.materialize.search import AlphaBeta, CollectivesOnly, CostModel
from lightning_nnscaler.materialize.tags import ChannelTags
from lightning_nnscaler.materialize.written import Written, WrittenPieces

PieceKey = tuple[Segment, str, IndexMask, object]
SKIPPED = "<not built>"
"""The variable of a piece a rank-local materialization did not fetch (on a rank whose code it does not build)."""


class MaterializeError(NnScalerError, ValueError):
    """A piece cannot be assembled from what the plan produces; names the op and the tensor."""


def materialize(
    graph: Graph, world_size: int, *, validate: bool = True, collectives: bool = True, cost: CostModel | None = None,
    shared_stages: frozenset[int] = frozenset(), rank: int | None = None,
) -> Program:
    """Lower a placed graph into per-rank programs (see the module docstring).

    Args:
        graph: The placed graph.
        world_size: Number of ranks.
        validate: False skips ``validate_plan`` for a graph the caller has just validated.
        collectives: Let the RVD search replace point-to-point transfers by collectives where cheaper.
        cost: The cost model the search prices steps with (default: alpha-beta).
        shared_stages: Pipeline stages that every rank runs at its own point of its own list (the
            interlaced pipeline's vocabulary layers): their pieces meet only by collectives, never by
            point-to-point messages, which could pair with the pipeline's own messages in another order.
        rank: Build only this rank's program whole (``Program.local_rank``, see the module docstring); a plan that
            does not pipeline is built whole all the same (its early sends look at each sender's whole program).
    """
    if validate:
        validate_plan(graph, world_size)
    return _Builder(graph, world_size, cost if collectives else None, collectives, shared_stages, rank).run()


def _bounding(masks: list[IndexMask]) -> IndexMask:
    return IndexMask(tuple((min(r[d][0] for r in (m.ranges for m in masks)), max(r[d][1] for r in (m.ranges for m in masks))) for d in range(len(masks[0].ranges))))


class _Builder:
    def __init__(
        self, graph: Graph, world_size: int, cost: CostModel | None, collectives: bool, shared_stages: frozenset[int] = frozenset(),
        rank: int | None = None,
    ) -> None:
        self.graph = graph
        self.cost = cost
        self.collectives = collectives
        self.shared_stages = shared_stages
        self.routed: set[tuple[str, str, int]] = set()
        self.pieces_of: dict[str, list] = defaultdict(list)
        for op in graph.ops:
            self.pieces_of[op.source_name].append(op)
        self.programs = [RankProgram(rank) for rank in range(world_size)]
        self.written: dict[str, WrittenPieces] = defaultdict(WrittenPieces)
        self.cache: list[dict[PieceKey, str]] = [{} for _ in range(world_size)]
        self.names = VariableNames(world_size)
        self.held: dict[tuple[int, str], list[tuple[str, IndexMask]]] = defaultdict(list)
        self.tags = ChannelTags(world_size)
        self.segment_of: dict[tuple[int, str], Segment] = {}  # (rank, variable) -> segment defining it
        self.prologue_received: dict[tuple[int, str, tuple, int], str] = {}
        self.pipelined = any(op.segment is not None for op in graph.ops)
        with_gradients = {(op.device, op.segment) for op in graph.ops if not op.no_grad}
        self.no_grad_segments = {(op.device, op.segment) for op in graph.ops} - with_gradients  # recycling passes
        if self.pipelined:
            loose = [op.name for op in graph.ops if op.segment is None]
            if loose:
                raise MaterializeError(f"a pipelined plan must give every op a segment; {_first(loose)} have none")
        self.local = rank if self.pipelined else None  # the one rank built whole (None: every rank)
        self.local_pieces: dict[str, list[VTensor]] = defaultdict(list)  # tensor -> the pieces ``local`` wrote

    def var(self, rank: int, base: str) -> str:
        return self.names.new(rank, base)

    def run(self) -> Program:
        self.hold_graph_inputs()
        for position, op in enumerate(self.graph.ops):
            rank = op.device
            if self.local is None or rank == self.local:
                input_vars = tuple(self.obtain(rank, piece, position, op, index) for index, piece in enumerate(op.tensor_inputs))
                output_vars = tuple(self.var(rank, output.name) for output in op.outputs)
                self.programs[rank].actions.append(Compute(position, op, input_vars, output_vars))
            else:
                for index, piece in enumerate(op.tensor_inputs):
                    self.obtain_elsewhere(rank, piece, position, op, index)
                output_vars = tuple(f"{output.name}@{position}" for output in op.outputs)  # a key: this rank's code is not built
            for output, var in zip(op.outputs, output_vars):
                self.written[output.name].add(Written(output, rank, var, position))
                self.segment_of[(rank, var)] = op.segment
                self.cache[rank].setdefault((op.segment, output.name, output.index, output.value), var)
                if rank == self.local:
                    self.local_pieces[output.name].append(output)
        self.collect_outputs()
        ordered_ops = {name for edge in self.graph.order_edges for name in edge}
        for program in self.programs:
            program.actions.sort(key=_action_order)
            if not self.pipelined:  # segments keep their actions; the prologue already runs first
                issue_sends_early(program, ordered_ops)
        updates = {new: self.graph.tensors[buffer].state_key for buffer, new in self.graph.buffer_updates.items()}
        loss = self.graph.outputs[0] if self.graph.outputs else None
        return Program(len(self.programs), self.programs, self.gradient_groups(), loss, updates, local_rank=self.local)

    # --- graph inputs -------------------------------------------------------------------------

    def hold_graph_inputs(self) -> None:
        """Each rank holds the bounding box of every graph input it reads; partially overlapping
        parameter boxes on different ranks grow to their union so gradient groups are exact."""
        needed: dict[str, dict[int, list[IndexMask]]] = defaultdict(lambda: defaultdict(list))
        for op in self.graph.ops:
            for piece in op.tensor_inputs:
                if self.graph.tensors[piece.name].role != "activation" and piece.value.part == 0:
                    needed[piece.name][op.device].append(piece.index)
        for name, by_rank in needed.items():
            boxes = {rank: _held_boxes(masks) for rank, masks in by_rank.items()}
            if self.graph.tensors[name].role == "parameter":
                boxes = _merge_partial_overlaps(boxes)
            tensor = self.graph.tensors[name]
            for rank, rank_boxes in sorted(boxes.items()):
                for box in rank_boxes:
                    var = self.var(rank, name)
                    self.held[(rank, name)].append((var, box))
                    self.programs[rank].inputs.append(LocalTensor(var, name, tensor.state_key, box_of(box), tensor.role))

    def gradient_groups(self) -> list[GradientGroup]:
        """The parameter boxes several ranks sum, in the module's registration order (``graph.parameters``): the order
        the gradient buckets are cut in reverse, as backward roughly produces the gradients."""
        registered = {tensor.name: index for index, tensor in enumerate(self.graph.parameters)}
        groups: dict[tuple[str, tuple], list[int]] = defaultdict(list)
        for (rank, name), held in sorted(self.held.items(), key=lambda item: (registered.get(item[0][1], len(registered)), item[0][1], item[0][0])):
            tensor = self.graph.tensors[name]
            if tensor.role == "parameter" and tensor.requires_grad:
                for _, box in held:
                    groups[(name, box_of(box))].append(rank)
        return [GradientGroup(name, self.graph.tensors[name].state_key or name, box, tuple(ranks)) for (name, box), ranks in groups.items()]

    # --- pieces ---------------------------------------------------------------------------------

    def obtain(self, rank: int, piece: VTensor, position: int, reader: Op, input_index: int) -> str:
        segment = reader.segment
        key = (segment, piece.name, piece.index, piece.value)
        prologue_key = (PROLOGUE, *key[1:])
        if key in self.cache[rank]:
            return self.cache[rank][key]
        if self.pipelined and prologue_key in self.cache[rank]:
            return self.cache[rank][prologue_key]
        if self.graph.tensors[piece.name].role != "activation":
            var = self.slice_held(rank, piece, position, segment)
        elif self.collectives and self.route_collectively(piece, position, reader, input_index):
            return self.cache[rank][key]
        else:
            var = self.fetch(rank, piece, position, reader.name, segment)
        self.cache[rank][key] = var
        return var

    def obtain_elsewhere(self, rank: int, piece: VTensor, position: int, reader: Op, input_index: int) -> None:
        """``obtain`` on a rank other than ``local`` as far as ``local`` takes part: the collectives, and the fetches
        ``local`` may serve (it holds an overlapping piece); any other read is recorded as done, so that a later
        read of the same piece on that rank is skipped as the whole materialization would skip it."""
        key = (reader.segment, piece.name, piece.index, piece.value)
        cache = self.cache[rank]
        if key in cache or (self.pipelined and (PROLOGUE, *key[1:]) in cache):
            return
        if self.graph.tensors[piece.name].role != "activation":
            cache[key] = SKIPPED  # held inputs are sliced locally
        elif self.collectives and self.route_collectively(piece, position, reader, input_index):
            return
        elif any(written.index.intersect(piece.index) is not None for written in self.local_pieces.get(piece.name, ())):
            cache[key] = self.fetch(rank, piece, position, reader.name, reader.segment)
        else:
            cache[key] = SKIPPED

    def visible(self, rank: int, var: str, segment: Segment) -> bool:
        """Whether a function of ``segment`` on ``rank`` can read ``var`` (its own, or the prologue's)."""
        defined_in = self.segment_of.get((rank, var))
        return defined_in == segment or defined_in == PROLOGUE

    def slice_held(self, rank: int, piece: VTensor, position: int, segment: Segment = None) -> str:
        if piece.value.part > 0:
            return self.zeros(rank, piece, position, segment)
        held_var, box = next((var, box) for var, box in self.held[(rank, piece.name)] if piece.index == box or piece.index.intersect(box) == piece.index)
        if piece.index == box:
            return held_var
        region = piece.index.slices_within(box)
        full = tuple(slice(0, size) for size in piece.shape)
        var = self.var(rank, f"{piece.name}_piece")
        fragment = Fragment(held_var, region, full, whole=False)
        self.programs[rank].actions.append(Assemble(position - 0.25, var, piece, (fragment,), segment=segment))
        self.segment_of[(rank, var)] = segment
        return var

    def zeros(self, rank: int, piece: VTensor, position: int, segment: Segment = None) -> str:
        var = self.var(rank, f"{piece.name}_zero_part")
        self.programs[rank].actions.append(Assemble(position - 0.25, var, piece, (), zeros=True, segment=segment))
        self.segment_of[(rank, var)] = segment
        return var

    def fetch(self, rank: int, piece: VTensor, position: int, reader: str, segment: Segment = None) -> str:
        written = self.written.get(piece.name, WrittenPieces())
        exact = written.exactly(piece.index, piece.value)
        if not exact and piece.value.part > 0:
            return self.zeros(rank, piece, position, segment)
        candidates = exact or written.overlapping(piece.index)
        distinct: dict[tuple, list[Written]] = defaultdict(list)
        for entry in candidates:
            if entry[0].index.intersect(piece.index) is not None:
                distinct[(entry[0].index, entry[0].value)].append(entry)
        self.check_coverage(piece, [holders[0][0] for holders in distinct.values()], reader)
        fragments = []
        for holders in distinct.values():
            source, holder_rank, source_var, produced_at = self.choose_holder(holders, rank, segment)
            overlap = source.index.intersect(piece.index)
            source_region = () if overlap == source.index else overlap.slices_within(source.index)
            target_region = overlap.slices_within(piece.index)
            whole = overlap == piece.index == source.index
            if holder_rank != rank or not self.visible(rank, source_var, segment):
                source_var = self.transfer(holder_rank, source_var, source_region, rank, overlap.shape, piece, produced_at, segment)
                source_region = ()
                whole = overlap == piece.index
            fragments.append(Fragment(source_var, source_region, target_region, whole))
        if len(fragments) == 1 and fragments[0].whole:
            return fragments[0].var
        var = self.var(rank, f"{piece.name}_assembled")
        self.programs[rank].actions.append(Assemble(position - 0.25, var, piece, tuple(fragments), segment=segment))
        self.segment_of[(rank, var)] = segment
        return var

    def choose_holder(self, holders: list[Written], rank: int, segment: Segment) -> Written:
        """A replica this segment can read directly if there is one, else one of the same segment
        (a tensor-parallel peer), else spread over the replicas deterministically."""
        if self.pipelined:
            for holder in holders:
                if holder[1] == rank and self.visible(rank, holder[2], segment):
                    return holder
            same_segment = [holder for holder in holders if self.segment_of[(holder[1], holder[2])] == segment]
            holders = same_segment or holders
        return _choose_holder(holders, rank)

    def route_collectively(self, piece: VTensor, position: int, reader: Op, input_index: int) -> bool:
        """Serve every piece of ``reader``'s origin reading this input with collectives, if the RVD
        search finds a runnable path; registers each device's result and returns True."""
        segment = reader.segment
        attempt = (piece.name, reader.source_name, input_index, segment)
        if attempt in self.routed:
            return False
        self.routed.add(attempt)
        targets: dict[int, VTensor] = {}
        for sibling in self.pieces_of[reader.source_name]:
            if sibling.segment != segment:
                continue  # another microbatch or stage: its own collective, in its own segment
            wanted = sibling.tensor_inputs[input_index]
            if targets.setdefault(sibling.device, wanted) != wanted:
                return False  # several pieces on one device (co-shard): not one layout
        by_rank: dict[int, dict[VTensor, str]] = defaultdict(dict)
        for written, rank, var, _ in self.written.get(piece.name, WrittenPieces()).entries:
            if self.pipelined and self.segment_of[(rank, var)] != segment:
                continue  # another segment's piece: other rows, or a copy this segment has too
            by_rank[rank].setdefault(written, var)
        if not by_rank:
            return False  # produced by other segments only: boundary messages, not a collective
        sources: dict[int, tuple[VTensor, str]] = {}
        for rank, pieces in by_rank.items():
            merged = _merge_local_value_parts(list(pieces))
            if merged is None:
                return False
            sources[rank] = (merged, None if len(pieces) > 1 else next(iter(pieces.values())))
        if all(sources.get(rank, (None,))[0] == wanted for rank, wanted in targets.items()):
            return False  # every device already holds what it reads
        shared = self.pipelined and segment != PROLOGUE and segment[0] in self.shared_stages
        if shared and self.broadcast(sources, targets, position, segment):
            return True
        search_sources, search_targets = {rank: entry[0] for rank, entry in sources.items()}, targets
        if self.pipelined:  # a segment's pieces cover its microbatch's rows: search within them
            search_sources, search_targets = _within_common_box(search_sources), _within_common_box(targets)
        # Where a device adds up several value parts (co-shard's shards), the point-to-point
        # fallback would move every part on its own, not the sum the search priced: collectives win.
        summed = any(len(pieces) > 1 for pieces in by_rank.values())
        cost = CollectivesOnly(self.cost or AlphaBeta()) if shared or summed else self.cost
        path = collective_path(search_sources, search_targets, cost)
        if path is None:
            if shared:
                raise MaterializeError(
                    f"op {reader.name!r} of shared stage {segment[0]} reads %{piece.name}, which its pieces on ranks "
                    f"{sorted(sources)} cannot bring to ranks {sorted(targets)} by collectives; a shared stage's ranks run "
                    "it at different points of their lists, so point-to-point messages could pair wrongly"
                )
            return False
        within = next(iter(search_targets.values()))
        current = {rank: var or self.sum_locally(rank, merged, by_rank[rank], position, segment) for rank, (merged, var) in sources.items()}
        for step_index, step in enumerate(path.steps):
            at = position - 0.4 + 0.01 * input_index + 0.001 * step_index
            for rank in sorted(current):
                current[rank] = self.collective_step(rank, step, current[rank], within, at, segment)
        for rank, wanted in targets.items():
            self.cache[rank][(segment, wanted.name, wanted.index, wanted.value)] = current[rank]
        return True

    def broadcast(self, sources: dict[int, tuple[VTensor, str | None]], targets: dict[int, VTensor], position: int, segment: Segment) -> bool:
        """One rank holds exactly what every target reads: a broadcast from it (registers each result)."""
        if len(sources) != 1:
            return False
        ((src, (piece, var)),) = sources.items()
        if var is None or src not in targets or any(wanted != piece for wanted in targets.values()):
            return False
        ranks = tuple(sorted(targets))
        nbytes = math.prod(piece.shape) * DTYPE_BYTES.get(piece.tensor.dtype, 4)
        for rank in ranks:
            result = self.var(rank, f"{piece.name}_broadcast")
            self.segment_of[(rank, result)] = segment
            self.programs[rank].actions.append(Collective(
                position - 0.4, "broadcast", result, var if rank == src else "None", ranks, bytes_per_device=nbytes if rank == src else 0,
                segment=segment, src=src, shape=piece.shape, dtype=piece.tensor.dtype,
            ))
            self.cache[rank][(segment, piece.name, piece.index, piece.value)] = result
        return True

    def sum_locally(self, rank: int, merged: VTensor, pieces: dict[VTensor, str], position: int, segment: Segment = None) -> str:
        """Add a device's value parts of one box (e.g. co-shard's shards) before a collective."""
        var = self.var(rank, f"{merged.name}_local_sum")
        full = tuple(slice(0, size) for size in merged.shape)
        fragments = tuple(Fragment(source_var, (), full, whole=True) for source_var in pieces.values())
        self.programs[rank].actions.append(Assemble(position - 0.45, var, merged, fragments, segment=segment))
        self.segment_of[(rank, var)] = segment
        return var

    def collective_step(self, rank: int, step: object, source_var: str, piece: VTensor, position: float, segment: Segment = None) -> str:
        shape = piece.tensor.shape
        if step.kind == "local-value-split":
            if step.after.piece_of(rank, shape)[1].part == 0:
                return source_var
            return self.zeros(rank, VTensor(piece.tensor, *step.after.piece_of(rank, shape)), position + 0.25, segment)
        var = self.var(rank, f"{piece.name}_{step.kind.replace('-', '_')}")
        self.segment_of[(rank, var)] = segment
        if step.kind == "local-chunk":
            before, after = step.before.piece_of(rank, shape)[0], step.after.piece_of(rank, shape)[0]
            fragment = Fragment(source_var, after.slices_within(before), tuple(slice(0, size) for size in after.shape), whole=False)
            self.programs[rank].actions.append(Assemble(position, var, VTensor(piece.tensor, after), (fragment,), segment=segment))
            return var
        kind = step.kind.replace("-", "_")
        dim = step.dims[0] if step.dims else 0
        self.programs[rank].actions.append(
            Collective(position, kind, var, source_var, group_of(step, rank), dim, 0, step.bytes_per_device, segment=segment)
        )
        return var

    def transfer(
        self, src: int, source_var: str, region: tuple[slice, ...], dst: int, shape: tuple[int, ...], piece: VTensor,
        produced_at: float, segment: Segment = None,
    ) -> str:
        """Bring ``source_var[region]`` from rank ``src`` to a function of ``segment`` on rank ``dst``."""
        source_segment = self.segment_of.get((src, source_var))
        if source_segment == PROLOGUE and segment != PROLOGUE:  # received once, in this rank's prologue
            key = (src, source_var, tuple((part.start, part.stop) for part in region), dst)
            if key not in self.prologue_received:
                self.prologue_received[key] = self.transfer(src, source_var, region, dst, shape, piece, produced_at, PROLOGUE)
            return self.prologue_received[key]
        boundary = source_segment != segment
        gradient = piece.tensor.dtype.startswith(("float", "bfloat", "complex")) and (src, source_segment) not in self.no_grad_segments
        tag = self.tags.next(src, dst)
        self.programs[src].actions.append(Send(produced_at + 0.1, source_var, region, dst, tag, source_segment, boundary, gradient))
        var = self.var(dst, f"{piece.name}_from_{src}")
        # Received right after it is sent: between two ranks, receives then follow the order of the
        # sends, as NCCL (which ignores tags) requires; the wait is only for data already produced.
        self.programs[dst].actions.append(Recv(produced_at + 0.1, var, shape, piece.tensor.dtype, src, tag, segment, boundary, gradient))
        self.segment_of[(dst, var)] = segment
        return var

    def check_coverage(self, piece: VTensor, sources: list[VTensor], reader: str) -> None:
        """Every element must be covered by value parts adding up to exactly one whole (or by copies
        of the piece's own value share)."""
        if all(source.value == piece.value for source in sources):  # the same value share, moved (a microbatch's loss part)
            shares = [(source.index, ValueMask(0, 1)) for source in sources]
        else:
            shares = [(source.index, source.value) for source in sources]
        if not covers_exactly(piece.index, shares):
            raise MaterializeError(
                f"op {reader!r} reads {piece} but the pieces written before it do not add up to it exactly; "
                "check the op_trans splits of its producers"
            )

    def collect_outputs(self) -> None:
        for name in [*self.graph.outputs, *self.graph.buffer_updates.values()]:
            seen: set[tuple] = set()
            for piece, rank, var, _ in sorted(self.written[name].entries, key=lambda entry: entry.rank):
                key = (piece.index, piece.value)
                self.programs[rank].outputs.append(RankOutput(name, var, piece, key not in seen, self.segment_of[(rank, var)]))
                seen.add(key)


def _within_common_box(pieces: dict[int, VTensor]) -> dict[int, VTensor]:
    """The pieces as pieces of their bounding box (a tensor of that shape), for the layout search."""
    box = _bounding([piece.index for piece in pieces.values()])
    first = next(iter(pieces.values())).tensor
    if box == IndexMask.full(first.shape):
        return pieces
    tensor = PTensor(first.name, box.shape, first.dtype, first.role, first.state_key, first.requires_grad)
    return {
        rank: VTensor(tensor, IndexMask(tuple((start - low, stop - low) for (start, stop), (low, _) in zip(piece.index.ranges, box.ranges))), piece.value)
        for rank, piece in pieces.items()
    }


def _merge_local_value_parts(pieces: list[VTensor]) -> VTensor | None:
    """One device's pieces as one: itself, or consecutive value parts of one box added up
    (parts k*s .. k*s+s-1 of n become part k of n/s); ``None`` when they do not combine."""
    if len(pieces) == 1:
        return pieces[0]
    first = pieces[0]
    parts = sorted(piece.value.part for piece in pieces)
    count, total = len(parts), first.value.parts
    if any(piece.index != first.index or piece.value.parts != total for piece in pieces):
        return None
    if total % count or parts != list(range(parts[0], parts[0] + count)) or parts[0] % count:
        return None
    return VTensor(first.tensor, first.index, ValueMask(parts[0] // count, total // count))


def _action_order(action: object) -> tuple[float, int]:
    """By position; at one position sends come before receives (a stable sort keeps the messages of one
    position in the order they were created, which between two ranks is the order of their tags)."""
    return (action.position, 0 if isinstance(action, Send) else 1)


def _choose_holder(holders: list[Written], rank: int) -> Written:
    """A local replica if there is one, else spread readers over the replicas deterministically."""
    for holder in holders:
        if holder[1] == rank:
            return holder
    ordered = sorted(holders, key=lambda holder: holder[1])
    return ordered[rank % len(ordered)]


def _held_boxes(masks: list[IndexMask]) -> list[IndexMask]:
    """The boxes a rank holds to read ``masks``: the bounding box of each group of masks that
    overlap or, side by side, tile their bounding box (one box, as before, unless the pieces lie apart)."""
    boxes = list(dict.fromkeys(masks))
    merged = True
    while merged:
        merged = False
        for first, second in itertools.combinations(boxes, 2):
            bounding = _bounding([first, second])
            tiles = _volume(bounding) == _volume(first) + _volume(second)
            if first.intersect(second) is not None or tiles:
                boxes = [box for box in boxes if box not in (first, second)] + [bounding]
                merged = True
                break
    return sorted(boxes, key=lambda box: box.ranges)


def _volume(box: IndexMask) -> int:
    return math.prod(box.shape)


def _merge_partial_overlaps(boxes: dict[int, list[IndexMask]]) -> dict[int, list[IndexMask]]:
    """Parameter boxes of different ranks that partially overlap grow to their union, so that
    every two held boxes are equal or disjoint (gradient groups are exact)."""
    distinct = {box: box for rank_boxes in boxes.values() for box in rank_boxes}  # box -> the box it grows into
    changed = True
    while changed:
        changed = False
        for first, second in itertools.combinations(sorted(set(distinct.values()), key=lambda box: box.ranges), 2):
            if first.intersect(second) is not None:
                merged = _bounding([first, second])
                for original, current in distinct.items():
                    if current in (first, second):
                        distinct[original] = merged
                changed = True
                break
    return {rank: sorted({distinct[box] for box in rank_boxes}, key=lambda box: box.ranges) for rank, rank_boxes in boxes.items()}


def _first(names: list[str]) -> str:
    return ", ".join(repr(name) for name in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
