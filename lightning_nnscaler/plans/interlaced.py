"""The interlaced pipeline's shared layers (nnScaler, Lin et al. OSDI 2024, §6): which ops run on every
rank, split by vocabulary, and how each of them is placed.

A large-vocabulary model spends much of its memory and work in the token embedding and the output
projection. The interlaced plan splits those by vocabulary over *all* the ranks of a pipeline, and
runs them as two shared stages (``schedules.interlaced``) around the pipeline stages:

- stage 0: each **lookup** (an embedding into the large table) split by vocabulary rows: every rank
  looks up the ids of its slice, zeros for the others (``ir.vocab``); a **gather** added after each
  lookup (a copy, ``gather_lookups``) is replicated on every rank, so an all-reduce inside the stage
  adds the slices up and the pipeline stage that reads it finds it on its own rank;
- stage ``p + 1``: the op writing the projection's input (the **hand-in**, e.g. the final norm) runs
  on the last pipeline rank, which broadcasts its output inside the stage; each **projection** (a
  linear onto the vocabulary) is split by output rows, and the split flows on through what follows
  (the **tail**) where it can: a summed cross-entropy over the logits becomes row sums, per-slice
  value parts and the loss from their sums (``ir.vocab``), so only two numbers per token cross the
  ranks, never the logits; what the split does not reach is replicated on every rank.

So the shared stages meet the pipeline in memory, on the neighbour stage's rank, and all their
communication is collectives inside the stage, run by every rank at the same point of its list.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir.op import Op
from lightning_nnscaler.ir.rules import annotate_op
from lightning_nnscaler.ir.rules.common import argument
from lightning_nnscaler.ir.tensor import PTensor, VTensor
from lightning_nnscaler.ir.vocab import LOSS_FROM_PARTS_OP, VOCAB_EMBEDDING_OP, VOCAB_LOSS_PARTS_OP
from lightning_nnscaler.plans.megatron_tp import final_linears, is_linear

LOOKUPS = ("aten.embedding.default", VOCAB_EMBEDDING_OP)


@dataclass(frozen=True)
class SharedLayers:
    """Op names of the interlaced plan's shared layers, by role (see the module docstring)."""

    lookups: tuple[str, ...]
    gathers: tuple[str, ...]
    hand_ins: tuple[str, ...]
    projections: tuple[str, ...]
    tail: tuple[str, ...]

    @property
    def input_stage(self) -> set[str]:
        """The ops of the shared stage 0."""
        return {*self.lookups, *self.gathers}

    @property
    def output_stage(self) -> set[str]:
        """The ops of the shared last stage."""
        return {*self.hand_ins, *self.projections, *self.tail}


def find_shared_layers(graph: Graph, kinds: dict[str, str], names: Sequence[str] | None = None) -> SharedLayers:
    """The lookups into the largest embedding table and the linears onto its vocabulary (or the ops
    ``names`` gives), with the ops around them that the plan places alongside. ``kinds`` marks each
    op ``batch`` (on the batch's path: what pipeline stages cut), ``weights`` or ``prologue``.

    Raises:
        ValueError: when there is no large-vocabulary layer, a named op is unknown or is no lookup or
            linear, or a gather or the tail reads a pipeline stage's output (it cannot be shared).
    """
    ops = {op.name: op for op in graph.ops}
    if names:
        unknown = [name for name in names if name not in ops]
        if unknown:
            raise ValueError(f"interlaced: shared_layers names ops the graph does not have: {unknown}; op names look like {list(ops)[:6]}")
        wrong = [name for name in names if ops[name].target not in LOOKUPS and not is_linear(ops[name])]
        if wrong:
            raise ValueError(f"interlaced: shared_layers {wrong} are neither embedding lookups nor linears; only those split by vocabulary")
        chosen = list(names)
    else:
        chosen = _large_vocabulary_ops(graph)
    lookups = tuple(name for name in chosen if ops[name].target in LOOKUPS)
    projections = tuple(name for name in chosen if ops[name].target not in LOOKUPS)
    producer = {output.name: op for op in graph.ops for output in op.outputs}
    readers: dict[str, list[Op]] = {}
    for op in graph.ops:
        for piece in op.tensor_inputs:
            if piece.name in producer:
                readers.setdefault(producer[piece.name].name, []).append(op)
    hand_ins = tuple(dict.fromkeys(
        producer[ops[name].tensor_inputs[0].name].name for name in projections if ops[name].tensor_inputs[0].name in producer
    ))
    tail = _downstream(graph, projections, readers)
    shared = SharedLayers(lookups, (), hand_ins, projections, tail)
    _check_self_contained(graph, shared, producer, kinds)
    return shared


def _large_vocabulary_ops(graph: Graph) -> list[str]:
    """Lookups into the embedding table with the most rows, if it has at least 4 rows per column, and
    the final linears (no linear downstream: the heads, not an MLP that happens to be as wide) whose
    output features are that many."""
    tables = {op.tensor_inputs[0].tensor.shape for op in graph.ops if op.target in LOOKUPS and op.tensor_inputs[0].tensor.role == "parameter"}
    large = max((shape for shape in tables if len(shape) == 2 and shape[0] >= 4 * shape[1]), default=None, key=lambda shape: shape[0])
    if large is None:
        raise ValueError(
            "interlaced: the model has no large-vocabulary embedding (a table with at least 4 rows per column); "
            "name the ops to share with shared_layers='op,op' (embedding lookups and linears onto the vocabulary), or use 1f1b"
        )
    vocabulary = large[0]
    final = final_linears(graph)
    return [
        op.name for op in graph.ops
        if (op.target in LOOKUPS and op.tensor_inputs[0].tensor.shape == large)
        or (is_linear(op) and op.source_name in final and op.outputs and op.outputs[0].shape[-1] == vocabulary)
    ]


def _downstream(graph: Graph, starts: Sequence[str], readers: dict[str, list[Op]]) -> tuple[str, ...]:
    """Every op reading, directly or not, what ``starts`` write (in graph order)."""
    reached: set[str] = set()
    frontier = list(starts)
    while frontier:
        for reader in readers.get(frontier.pop(), []):
            if reader.name not in reached:
                reached.add(reader.name)
                frontier.append(reader.name)
    return tuple(op.name for op in graph.ops if op.name in reached and op.name not in starts)


def _check_self_contained(graph: Graph, shared: SharedLayers, producer: dict[str, Op], kinds: dict[str, str]) -> None:
    """The tail may read only the output stage and what needs no pipeline stage."""
    for role, names, allowed in (("follows the vocabulary projection", shared.tail, shared.output_stage),):
        for name in names:
            op = next(op for op in graph.ops if op.name == name)
            for piece in op.tensor_inputs:
                source = producer.get(piece.name)
                if source is not None and source.name not in allowed and kinds[source.name] == "batch":
                    raise ValueError(
                        f"interlaced: op {name!r} ({op.target}) {role} and also reads %{piece.name} from op {source.name!r}, "
                        "a pipeline stage's output; the shared layers must meet the pipeline at one tensor. "
                        "Name the shared ops with shared_layers='op,op', or use 1f1b"
                    )



def gather_lookups(graph: Graph, shared: SharedLayers) -> SharedLayers:
    """After each lookup, a copy of its output that its readers read instead (the **gather**): placed on
    every rank in the input stage, it is where the vocabulary slices' value parts are all-reduced, so
    the lookup's readers (a scale, a residual add) stay in the pipeline stages, on one rank each.
    Returns ``shared`` with the gathers."""
    gathers = []
    for name in shared.lookups:
        lookup = graph.op(name)
        output = lookup.outputs[0]
        gathered = PTensor(f"{name}_gathered", output.tensor.shape, output.tensor.dtype, "activation")
        graph.tensors[gathered.name] = gathered
        for reader in [op for op in graph.ops if any(piece.name == output.name for piece in op.tensor_inputs)]:
            args, kwargs = reader.map_tensor_inputs(
                lambda _, piece: VTensor(gathered, piece.index, piece.value) if piece.name == output.name else piece
            )
            graph.replace_op(reader, [replace(reader, args=args, kwargs=kwargs)])
        copy = Op(gathered.name, "aten.clone.default", (output,), outputs=(gathered.full(),), no_grad=lookup.no_grad)
        graph.replace_op(lookup, [lookup, replace(copy, annotation=annotate_op(copy))])
        gathers.append(gathered.name)
    return replace(shared, gathers=tuple(gathers))


def vocabulary_parallel_losses(graph: Graph, shared: SharedLayers) -> SharedLayers:
    """Rewrite each summed cross-entropy of the tail into three ops a vocabulary split can flow through:
    ``sum(logits, -1)`` (row sums), ``lnn.vocab_loss_parts`` and ``lnn.loss_from_parts`` (``ir.vocab``);
    returns ``shared`` with them in the tail. A cross-entropy with class weights, label smoothing or
    other than 2-d logits stays as it is (its logits are gathered whole)."""
    tail = list(shared.tail)
    for op in list(graph.ops):
        if op.name not in shared.tail or op.target != "aten.cross_entropy_loss.default":
            continue
        logits, targets = op.tensor_inputs[:2]
        plain = argument(op, 2, "weight", None) is None and argument(op, 5, "label_smoothing", 0.0) == 0.0
        if not plain or argument(op, 3, "reduction", 1) != 2 or len(logits.shape) != 2 or logits.index != logits.tensor.full().index:
            continue
        rows, vocabulary = logits.shape
        row_sums = PTensor(f"{op.name}_row_sums", (rows,), logits.tensor.dtype, "activation")
        parts = PTensor(f"{op.name}_parts", (rows, 2), logits.tensor.dtype, "activation")
        graph.tensors[row_sums.name], graph.tensors[parts.name] = row_sums, parts
        replacements = [
            Op(row_sums.name, "aten.sum.dim_IntList", (logits, [-1]), outputs=(row_sums.full(),)),
            Op(parts.name, VOCAB_LOSS_PARTS_OP, (logits, row_sums.full(), targets, 0, vocabulary), outputs=(parts.full(),)),
            Op(op.name, LOSS_FROM_PARTS_OP, (parts.full(), row_sums.full(), targets, vocabulary, argument(op, 4, "ignore_index", -100)), outputs=op.outputs),
        ]
        graph.replace_op(op, [replace(new, annotation=annotate_op(new), no_grad=op.no_grad) for new in replacements])
        tail[tail.index(op.name):tail.index(op.name)] = [row_sums.name, parts.name]
    return replace(shared, tail=tuple(tail))


def vocabulary_choice(shared: SharedLayers):
    """The output stage's split rule: projections by output rows (``n``); other ops follow the split that reaches them."""

    def choose(op: Op, offered: list[str]) -> str | None:
        if op.source_name in shared.projections:
            return "n"
        return offered[0] if offered else None

    return choose
