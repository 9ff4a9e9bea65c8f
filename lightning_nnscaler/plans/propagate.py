"""Split propagation: follow a partition from tensor to tensor through the ops' dimension annotations.

A walk visits ops in graph order, knowing which tensors are split into ``parts`` along which dim
(the seeds, then whatever it split itself). An op that reads a split tensor at dim ``i`` is offered
the name its annotation gives that dim (``inputs[position][i]``, the first name of a merged dim),
when that name may be split and ``parts`` divides it. A ``choose`` callback picks the name to split
the op by — by default the first name offered, so the split simply flows on; a recipe's callback
may also start a split no input offers (Megatron's column-split linear). After ``op_trans`` the
outputs carry the split at each dim that the name heads. Splitting a reduction name (``k+``) leaves
the outputs value-partial: the walk stops there (materialization will add the reduction), unless
``through_value`` is set, which lets a value split pass on through ops linear in that input
(``; value ...`` in the annotation), e.g. the final ``loss_sum / count`` of data parallelism.

Placement: piece ``j`` of ``p`` goes to ``devices[j * len(devices) // p]``, so with
``p = shards * len(devices)`` each device gets ``shards`` consecutive pieces; ops the walk left
whole are replicated, one copy per device of the group.

Refusals: when ``choose`` picks a name that the op may split but ``parts`` does not divide its
size (4 heads into 3 parts), the op is left whole and the walk records a `Refusal`: the plan is
weaker than the recipe meant. ``recording_refusals()`` collects the refusals of every walk run
inside it, so that a caller of an unchanged recipe function (``parallelize``) can refuse or warn
(``plans.coverage``); a name the op's annotation forbids splitting is the recipe's design, no refusal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from lightning_nnscaler.ir.annotation import AnnotationError
from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir.op import Op
from lightning_nnscaler.primitives import op_assign, op_trans

Choose = Callable[[Op, list[str]], "str | None"]
"""``choose(op, offered)``: the dim name to split ``op`` by, or ``None`` to leave it whole.
``offered`` lists the names (in input order, each once) at which split inputs arrive."""


@dataclass(frozen=True)
class Refusal:
    """An op a walk meant to split by ``dim`` into ``parts`` pieces but left whole: ``parts`` does not divide ``size``."""

    op: str
    """The op of the captured graph (``Op.source_name``)."""
    target: str
    """Its operator, e.g. ``"aten.linear.default"``."""
    dim: str
    """The annotation name it was to be split by (``n``: a linear's output features)."""
    size: int
    """The size of that dim."""
    parts: int
    """The pieces asked for."""

    def __str__(self) -> str:
        return f"op {self.op!r} ({self.target}): dim {self.dim!r} has size {self.size}, which {self.parts} parts do not divide"


_RECORDERS: ContextVar[tuple[list[Refusal], ...]] = ContextVar("lightning_nnscaler_refusals", default=())


@contextmanager
def recording_refusals(*, isolated: bool = False) -> Iterator[list[Refusal]]:
    """Collect the refusals of every walk run inside the block (nested blocks each get them all, unless the
    inner one is ``isolated``: then the enclosing blocks see none of its refusals, as for a plan search's
    candidates, each checked on its own)."""
    refusals: list[Refusal] = []
    token = _RECORDERS.set((() if isolated else _RECORDERS.get()) + (refusals,))
    try:
        yield refusals
    finally:
        _RECORDERS.reset(token)


def follow(op: Op, offered: list[str]) -> str | None:
    """The default choice: split by the first name a split input offers."""
    return offered[0] if offered else None


@dataclass
class Walk:
    """The ops a walk visited, in graph order, each with its pieces (``None``: left whole)."""

    steps: list[tuple[Op, list[Op] | None]] = field(default_factory=list)
    feeds: list[tuple[int, ...]] = field(default_factory=list)
    """Per step, the earlier steps whose split outputs it reads (empty where its split starts afresh)."""
    refused: list[Refusal] = field(default_factory=list)
    """Ops left whole although ``choose`` picked a name for them, because ``parts`` does not divide it."""

    @property
    def split(self) -> list[list[Op]]:
        """Pieces of every op the walk split."""
        return [pieces for _, pieces in self.steps if pieces is not None]

    @property
    def whole(self) -> list[Op]:
        """Ops no split reached (to be replicated)."""
        return [op for op, pieces in self.steps if pieces is None]

    def runs(self) -> list[list[list[Op]]]:
        """Stretches of split ops that one split flows through (an attention block, an MLP), in graph order.

        A whole op cuts a stretch; so does a split that starts afresh, reading no split the stretch
        made (the second of two MLPs in a row: its column split follows the first one's row split,
        whose partial sums are reduced in between).
        """
        stretch_of: dict[int, int] = {}
        runs: list[list[int]] = []
        open_from = 0  # stretches before this index were cut by a whole op
        for index, (_, pieces) in enumerate(self.steps):
            if pieces is None:
                open_from = len(runs)
                continue
            joined = sorted({stretch_of[feed] for feed in self._feeds(index) if stretch_of.get(feed, -1) >= open_from})
            if not joined:
                runs.append([])
                target = len(runs) - 1
            else:
                target = joined[0]
                for other in joined[1:]:  # a join (attention reading q, k and v) merges stretches
                    runs[target].extend(runs[other])
                    for member in runs[other]:
                        stretch_of[member] = target
                    runs[other] = []
            runs[target].append(index)
            stretch_of[index] = target
        return [[self.steps[index][1] for index in sorted(run)] for run in runs if run]  # type: ignore[misc]

    def _feeds(self, index: int) -> tuple[int, ...]:
        return self.feeds[index] if index < len(self.feeds) else ()


def propagate(
    graph: Graph,
    parts: int,
    *,
    seeds: dict[str, int] | None = None,
    ops: Iterable[str] | None = None,
    choose: Choose = follow,
    through_value: bool = False,
) -> Walk:
    """Split ops of ``graph`` into ``parts`` pieces wherever a split reaches them (see the module doc).

    Args:
        graph: The graph to edit (with ``op_trans`` only; nothing is placed).
        parts: Pieces per split op; 1 leaves every op whole.
        seeds: Tensor name -> dim already split into ``parts`` (e.g. the batch dim of user inputs).
        ops: Names of the ops to visit, in order (default: all); a region such as one
            data-parallel replica. Tensors are tracked by name, so a region must hold at most one
            piece of each tensor it splits.
        choose: Picks the name to split each op by (default: `follow`).
        through_value: Let value-partial tensors split the ops linear in them by value.

    Returns:
        The walk: each visited op with its pieces or ``None``, and its refusals (also handed to
        every active ``recording_refusals`` block).
    """
    index_splits = dict(seeds or {})  # tensor name -> dim cut into `parts`
    value_splits: set[str] = set()  # tensors held as `parts` partial sums
    walk = Walk()
    producer: dict[str, int] = {}  # split tensor name -> the step that split it
    for name in list(ops) if ops is not None else [op.name for op in graph.ops]:
        op = graph.op(name)
        chosen = choose(op, _offered_names(op, index_splits)) if parts > 1 else None
        followed: list[str] = []  # inputs already split the way this op is
        if chosen is not None and can_split(op, chosen, parts):
            followed = _inputs_following(op, chosen, index_splits)
            pieces = op_trans(graph, op, chosen, parts)
            _record_outputs(op, chosen, index_splits, value_splits)
        elif through_value and parts > 1 and _reads_value_split(op, value_splits):
            followed = [piece.name for piece in op.tensor_inputs if piece.name in value_splits]
            pieces = op_trans(graph, op, "value", parts)
            value_splits.update(output.name for output in op.outputs)
        else:
            pieces = None
            refused = None if chosen is None else refusal(op, chosen, parts)
            if refused is not None:
                walk.refused.append(refused)
        walk.feeds.append(tuple(sorted({producer[tensor] for tensor in followed if tensor in producer})))
        if pieces is not None:
            producer.update((output.name, len(walk.steps)) for output in op.outputs)
        walk.steps.append((op, pieces))
    for recorder in _RECORDERS.get():
        recorder.extend(walk.refused)
    return walk


def batch_dims(graph: Graph, parts: int) -> dict[str, int]:
    """Where the batch is, without editing ``graph``: tensor name -> the dim that a split of the user
    inputs' dim 0 into ``parts`` reaches (as `propagate` would split it), for every tensor it reaches.

    A reached dim has the batch as its outermost factor, so ``parts`` equal blocks of it hold the
    batch's ``parts`` equal blocks of rows, in order.
    """
    dims = {tensor.name: 0 for tensor in graph.user_inputs if tensor.rank >= 1 and tensor.shape[0] % parts == 0}
    for op in graph.ops:
        offered = _offered_names(op, dims)
        if offered and can_split(op, offered[0], parts):
            _record_outputs(op, offered[0], dims, set())
    return dims


def can_split(op: Op, name: str, parts: int) -> bool:
    """Whether ``op_trans(graph, op, name, parts)`` is allowed: a splittable name that ``parts`` divides."""
    size = _splittable_size(op, name)
    return size is not None and size % parts == 0


def refusal(op: Op, name: str, parts: int) -> Refusal | None:
    """The refusal to split ``op`` by ``name`` into ``parts``: ``None`` unless it is a splittable name
    whose size ``parts`` does not divide (a name the annotation forbids is no refusal: the op's design)."""
    size = _splittable_size(op, name)
    return None if size is None or size % parts == 0 else Refusal(op.source_name, op.target, name, size, parts)


def _splittable_size(op: Op, name: str) -> int | None:
    """The size of dim ``name`` of ``op``, ``None`` when its annotation does not let it be split."""
    annotation = op.dims
    if annotation is None or name not in annotation.splittable_names():
        return None
    try:
        sizes = annotation.name_sizes([piece.shape for piece in op.tensor_inputs], [piece.shape for piece in op.outputs])
    except AnnotationError:
        return None
    return sizes.get(name)


def place(graph: Graph, walk: Walk, devices: Sequence[int]) -> None:
    """Assign the walk's pieces over ``devices`` and replicate its whole ops, one copy per device."""
    for pieces in walk.split:
        assign_pieces(graph, pieces, devices)
    for op in walk.whole:
        assign_pieces(graph, replicate(graph, op, len(devices)), devices)


def assign_pieces(graph: Graph, pieces: Sequence[Op], devices: Sequence[int]) -> None:
    """Piece ``j`` of ``p`` -> ``devices[j * len(devices) // p]`` (consecutive pieces share a device)."""
    for index, piece in enumerate(pieces):
        op_assign(graph, piece, devices[index * len(devices) // len(pieces)])


def replicate(graph: Graph, op: Op | str, copies: int) -> list[Op]:
    """``copies`` identical pieces of ``op`` (the op itself when one copy)."""
    return [graph.op(op)] if copies == 1 else op_trans(graph, op, "replicate", copies)


def _offered_names(op: Op, index_splits: dict[str, int]) -> list[str]:
    annotation = op.dims
    if annotation is None:
        return []
    splittable = annotation.splittable_names()
    offered: list[str] = []
    for position, piece in enumerate(op.tensor_inputs):
        dim = index_splits.get(piece.name)
        if dim is None or position >= len(annotation.inputs):
            continue
        names = annotation.inputs[position][dim].names
        if names and names[0] in splittable and names[0] not in offered:
            offered.append(names[0])
    return offered


def _inputs_following(op: Op, name: str, index_splits: dict[str, int]) -> list[str]:
    """The inputs of ``op`` that already arrive split by ``name``, the split ``op`` takes (no communication between)."""
    annotation = op.dims
    if annotation is None:
        return []
    following: list[str] = []
    for position, piece in enumerate(op.tensor_inputs):
        dim = index_splits.get(piece.name)
        if dim is not None and position < len(annotation.inputs) and annotation.inputs[position][dim].names[:1] == (name,):
            following.append(piece.name)
    return following


def _record_outputs(op: Op, name: str, index_splits: dict[str, int], value_splits: set[str]) -> None:
    annotation = op.dims
    assert annotation is not None  # can_split checked it
    for output, spec in zip(op.outputs, annotation.outputs):
        if name in annotation.reduced:
            value_splits.add(output.name)
            continue
        dim = next((axis for axis, dim_spec in enumerate(spec) if dim_spec.names[:1] == (name,)), None)
        if dim is not None:
            index_splits[output.name] = dim


def _reads_value_split(op: Op, value_splits: set[str]) -> bool:
    annotation = op.dims
    if annotation is None:
        return False
    inputs = op.tensor_inputs
    return any(position < len(inputs) and inputs[position].name in value_splits for position in annotation.value_inputs)
