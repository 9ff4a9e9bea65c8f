"""op_trans: partition an op into functionally equivalent pieces, guided by its annotation."""

from __future__ import annotations

import itertools

from lightning_nnscaler.ir.errors import NnScalerError
from lightning_nnscaler.ir.rules import rule_for
from lightning_nnscaler.ir.annotation import AnnotationError, DimAnnotation
from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir.op import Op
from lightning_nnscaler.ir.tensor import VTensor


class TransformError(NnScalerError, ValueError):
    """A partition that the op's annotation does not allow."""


def op_trans(graph: Graph, op: Op | str, dim: str, parts: int) -> list[Op]:
    """Replace ``op`` in ``graph`` by ``parts`` pieces that together compute the same thing.

    Args:
        graph: The graph to edit.
        op: The op (or its name).
        dim: A dim name of the op's annotation to split spatially; ``"value"`` to split the op's
            linear inputs into partial sums; or ``"replicate"`` for identical copies.
        parts: Number of pieces (``>= 1``).

    Returns:
        The pieces, in place of ``op`` in the graph's order, named ``"<op>.<i>"``.

    Raises:
        TransformError: naming the op, the dim and the sizes when the split is not allowed.
    """
    op = graph.op(op)
    if not isinstance(parts, int) or parts < 1:
        raise TransformError(f"op {op.name!r}: parts must be a positive int, got {parts!r}")
    if dim == "replicate":
        pieces = [op.evolve(name=f"{op.name}.{i}", origin=op.source_name) for i in range(parts)]
    else:
        annotation = _annotation_of(op, dim)
        if dim == "value":
            pieces = _split_value(op, annotation, parts)
        else:
            pieces = _split_dim(op, annotation, dim, parts)
        rule = rule_for(op.target)
        if rule is not None and rule.rewrite is not None:
            pieces = [rule.rewrite(piece) for piece in pieces]
    graph.replace_op(op, pieces)
    graph.order_edges = _edges_through_pieces(graph.order_edges, op.name, [piece.name for piece in pieces])
    return pieces


def _annotation_of(op: Op, dim: str) -> DimAnnotation:
    if op.annotation is None:
        raise TransformError(
            f"op {op.name!r} ({op.target}) has no dimension annotation, so it can be replicated but not split by "
            f"{dim!r}; use op_trans(graph, op, 'replicate', n), or register one with "
            f"lightning_nnscaler.register_annotation({op.target!r})"
        )
    return op.dims  # parsed once per annotation text: every piece of an op shares it


def _split_value(op: Op, annotation: DimAnnotation, parts: int) -> list[Op]:
    if not annotation.value_inputs:
        raise TransformError(f"op {op.name!r} ({op.target}) is not linear in any input (annotation {op.annotation!r}); it cannot be split by value")
    pieces = []
    for index in range(parts):
        def cut(position: int, piece: VTensor, index: int = index) -> VTensor:
            return piece.split_value(parts)[index] if position in annotation.value_inputs else piece

        outputs = tuple(output.split_value(parts)[index] for output in op.outputs)
        pieces.append(_piece(op, index, cut, outputs))
    return pieces


def _split_dim(op: Op, annotation: DimAnnotation, name: str, parts: int) -> list[Op]:
    if name not in annotation.names:
        raise TransformError(f"op {op.name!r} ({op.target}) has no dim {name!r}; its annotation is {op.annotation!r}")
    if name not in annotation.splittable_names():
        raise TransformError(f"op {op.name!r} ({op.target}): dim {name!r} must not be split (annotation {op.annotation!r})")
    inputs, outputs = op.tensor_inputs, op.outputs
    try:
        sizes = annotation.name_sizes([piece.shape for piece in inputs], [piece.shape for piece in outputs])
    except AnnotationError as error:
        raise TransformError(f"op {op.name!r} ({op.target}): {error}") from None
    if sizes[name] % parts:
        raise TransformError(f"op {op.name!r} ({op.target}): dim {name!r} has size {sizes[name]}, which {parts} parts do not divide")
    reduced = name in annotation.reduced

    def positions(spec: tuple) -> int | None:
        return next((axis for axis, dim_spec in enumerate(spec) if dim_spec.names[:1] == (name,)), None)

    def cuts(piece: VTensor, axis: int | None, value_split: bool) -> list[VTensor] | None:
        if axis is not None:
            return piece.split_dim(axis, parts)
        return piece.split_value(parts) if value_split else None

    input_cuts = [
        cuts(piece, positions(spec), reduced and position in annotation.value_inputs)
        for position, (piece, spec) in enumerate(zip(inputs, annotation.inputs))
    ]
    output_cuts = [cuts(output, positions(spec), False) or [output] * parts for output, spec in zip(outputs, annotation.outputs)]
    if reduced:
        output_cuts = [[output.split_value(parts)[index] for index, output in enumerate(column)] for column in output_cuts]
    pieces = []
    for index in range(parts):
        def cut_input(position: int, piece: VTensor, index: int = index) -> VTensor:
            column = input_cuts[position]
            return piece if column is None else column[index]

        pieces.append(_piece(op, index, cut_input, tuple(column[index] for column in output_cuts)))
    return pieces


def _piece(op: Op, index: int, cut, outputs: tuple[VTensor, ...]) -> Op:
    args, kwargs = op.map_tensor_inputs(cut)
    return op.evolve(name=f"{op.name}.{index}", args=args, kwargs=kwargs, outputs=outputs, origin=op.source_name)


def _edges_through_pieces(edges: list[tuple[str, str]], old: str, new: list[str]) -> list[tuple[str, str]]:
    """An order edge on a partitioned op holds for each of its pieces (``edges`` itself when none names ``old``).

    O(E) for E edges, as a C-level scan when no edge names ``old`` (the usual case: ops are split
    before a schedule orders them), so splitting V ops costs O(V·E) only for edges added before the
    splits; an edge between ops cut in p and q pieces becomes p·q edges, one per pair of pieces.
    """
    if old not in itertools.chain.from_iterable(edges):
        return edges
    pieces_of = {old: new}
    return [
        (first, second)
        for before, after in edges
        for first in pieces_of.get(before, (before,))
        for second in pieces_of.get(after, (after,))
    ]
