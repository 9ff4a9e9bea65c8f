"""Plan coverage: did a recipe split the model as it means to, and does every rank work?

A recipe never silently makes a weaker plan than asked. Where it meant to split an op but the parts
do not divide the dim (Megatron tp over 3 ranks of 4 attention heads), its walk records a
``propagate.Refusal`` and leaves the op whole, replicated on each rank; ``check_coverage`` then
raises a ``RecipeError`` naming the module, the dim, its size and the parts, or — only when the
user asked for best effort (``allow_partial=True``) — warns with a `PartialPlanWarning` that says
how much of the model was split. What "split as the recipe means" is, per recipe:

- tp, hybrid (tp part), coshard: every op Megatron's choice splits (column- and row-split linears,
  the attention heads and FFN activations between them) is split into ``parts`` pieces
  (tp: ``degree``; hybrid: ``tp``; coshard: ``shards × world_size``).
- sp: as tp, and every op with an output ``(B, T, ...)`` split along T into ``world_size`` pieces.
- dp, zero1, zero3: the batch is split over all ranks (a batch the world does not divide already
  raises in ``dp.split_batch``); no op is meant to be split otherwise.
- Every recipe, and every hand-written plan: each rank runs at least one op (``validate_plan``).

Parameters are reported as split (no rank holds all of one) or replicated; the split fraction is
by elements, over the parameters some op reads.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import product

from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir.op import Op
from lightning_nnscaler.ir.tensor import IndexMask
from lightning_nnscaler.ir.validate import check_no_idle_rank
from lightning_nnscaler.plans.catalog import RecipeError
from lightning_nnscaler.plans.propagate import Refusal

ATTENTION = "aten.scaled_dot_product_attention.default"
_DIM_MEANINGS = {("aten.linear.default", "n"): "out features", ("aten.linear.default", "k"): "in features"}
_PACKED_QKV = "q, k, v packed in one projection: a split by heads would mix them"
_SEARCH_DEPTH = 6  # ops between a refused op and its attention (q_proj -> view -> transpose -> attention)
_MAX_MODULES = 4  # modules named per line before "and N more"


class PartialPlanWarning(UserWarning):
    """A plan, accepted with ``allow_partial=True``, that leaves whole some ops its recipe meant to split."""


@dataclass(frozen=True)
class ParameterCoverage:
    """How one parameter is laid out over the ranks."""

    key: str
    """Its ``state_dict`` key."""
    elements: int
    """Number of elements."""
    largest_share: int
    """The most elements of it that one rank reads."""

    @property
    def split(self) -> bool:
        """Whether it is partitioned: no rank holds all of it."""
        return self.largest_share < self.elements


@dataclass(frozen=True)
class CoverageReport:
    """What a plan split, and what its recipe meant to split but left whole."""

    recipe: str
    """The recipe's name."""
    world_size: int
    """Number of ranks."""
    parameters: tuple[ParameterCoverage, ...]
    """Every parameter some op reads, in graph input order."""
    refusals: tuple[Refusal, ...]
    """Ops the recipe meant to split but left whole (replicated), each once."""
    unsplit: tuple[str, ...] = ()
    """The refusals described by module, one line per kind of module (see `_describe`)."""

    @property
    def split_fraction(self) -> float:
        """Fraction of parameter elements that are partitioned over ranks (0.0 with no parameters)."""
        total = sum(parameter.elements for parameter in self.parameters)
        return sum(parameter.elements for parameter in self.parameters if parameter.split) / total if total else 0.0

    @property
    def complete(self) -> bool:
        """Whether the recipe split everything it meant to."""
        return not self.refusals

    def summary(self) -> str:
        """One paragraph: the split fraction, and what was left whole."""
        ranks = f"{self.world_size} rank{'s' if self.world_size != 1 else ''}"
        head = f"recipe {self.recipe!r} over {ranks} split {self.split_fraction:.0%} of the parameter elements"
        if self.complete:
            return head + "; it left nothing whole that it meant to split"
        return head + "; left whole (replicated) although the recipe means to split them:\n" + "\n".join(
            f"  - {line}" for line in self.unsplit
        )


def check_coverage(
    planned: Graph, original: Graph, world_size: int, *, recipe: str, allow_partial: bool = False,
    refusals: Sequence[Refusal] = (), model_parallel: int = 1,
) -> CoverageReport:
    """Check that ``planned`` splits what recipe ``recipe`` means to split and uses all ``world_size`` ranks.

    Args:
        planned: The planned graph (after the recipe).
        original: The graph the recipe planned (as traced); names the modules in messages.
        world_size: Number of ranks.
        recipe: The recipe's name, for messages.
        allow_partial: Warn instead of raising when the recipe left ops whole that it meant to split.
        refusals: What the recipe's walks refused (``propagate.recording_refusals`` around the recipe).
        model_parallel: Ranks per data-parallel replica (the recipe's layout): above 1, a plan in which
            every rank holds every parameter whole split nothing, and is refused (or warned of).

    Returns:
        The coverage report.

    Raises:
        IdleRankError: a rank runs no op (whatever ``allow_partial``: plan for fewer ranks instead).
        RecipeError: the recipe left ops whole that it meant to split, or found nothing to split
            although several ranks share a replica, unless ``allow_partial``.

    Warns:
        PartialPlanWarning: with ``allow_partial``, when the recipe left such ops whole.
    """
    check_no_idle_rank(planned, world_size)
    if model_parallel > 1 and not refusals and _replicated_everywhere(planned, world_size):
        message = (
            f"recipe {recipe!r} over {world_size} ranks ({model_parallel} per data-parallel replica) split nothing: every "
            "rank would run every op whole, repeating its replica's whole computation. The recipe found no op it splits "
            "(tp, sp and coshard split aten.linear layers and attention; e.g. a Conv1D written as addmm is not one). "
            "Use dp or zero3, or register a recipe that splits this model's ops"
        )
        if not allow_partial:
            raise RecipeError(message)
        warnings.warn(message, PartialPlanWarning, stacklevel=3)
    unique = tuple(dict.fromkeys(refusals))  # hybrid walks each data-parallel replica: the same refusal per replica
    lines, heads = _describe(original, unique)
    report = CoverageReport(recipe, world_size, tuple(parameter_coverage(planned)), unique, tuple(lines))
    if report.complete:
        return report
    sizes = sorted({refusal.size for refusal in unique} | heads)
    parts = sorted({refusal.parts for refusal in unique})
    if allow_partial:
        warnings.warn(report.summary() + ".", PartialPlanWarning, stacklevel=3)
        return report
    if all(_Neighbours(original).packs_qkv(refusal) for refusal in unique):
        raise RecipeError(
            f"{report.summary()}.\nTo fix: give the attention separate q, k and v linears (as "
            "lightning_nnscaler.models.gpt does) or use nn.MultiheadAttention (its packed in_proj is captured by heads), or pass allow_partial=True to keep these attention modules whole "
            "(replicated) and split the rest (a PartialPlanWarning then says how much of the model was split)."
        )
    raise RecipeError(
        f"{report.summary()}.\nTo fix: choose world_size and the recipe's parameters so that its parts (now "
        f"{_and(parts)}) divide {_and(sizes)}; or pass allow_partial=True to accept this weaker plan "
        "(a PartialPlanWarning then says how much of the model was split)."
    )


def _replicated_everywhere(planned: Graph, world_size: int) -> bool:
    """Whether every rank runs every op whole: no op was split (by a dim or by value), only copied."""
    ranks_of: dict[str, set[int | None]] = defaultdict(set)
    for op in planned.ops:
        if any(output.index != IndexMask.full(output.tensor.shape) or not output.value.is_full for output in op.outputs):
            return False
        ranks_of[op.source_name].add(op.device)
    return bool(ranks_of) and all(len(ranks) == world_size for ranks in ranks_of.values())


def parameter_coverage(planned: Graph) -> list[ParameterCoverage]:
    """Per parameter some op reads: its elements and the most of them one rank reads."""
    boxes: dict[str, dict[int | None, set[IndexMask]]] = defaultdict(lambda: defaultdict(set))
    for op in planned.ops:
        for piece in op.tensor_inputs:
            if piece.tensor.role == "parameter":
                boxes[piece.name][op.device].add(piece.index)
    coverage = []
    for tensor in planned.parameters:
        if tensor.name in boxes:
            largest = max(_union_size(list(held)) for held in boxes[tensor.name].values())
            coverage.append(ParameterCoverage(tensor.state_key or tensor.name, tensor.numel, largest))
    return coverage


def _describe(original: Graph, refusals: Sequence[Refusal]) -> tuple[list[str], set[int]]:
    """The refusals by module, modules refused alike on one line, e.g. ``attention modules
    blocks.0.attn, blocks.1.attn (4 heads, which 3 parts do not divide): q_proj, k_proj, v_proj,
    out_proj by dim 'n' of size 32 (3 parts)``; and the head counts of the attention modules among them."""
    neighbours = _Neighbours(original)
    units: dict[str, list[tuple[str, Refusal]]] = defaultdict(list)  # module -> (label in it, refusal)
    for refusal in refusals:
        op = neighbours.ops.get(refusal.op)
        unit, label = neighbours.unit_and_label(op) if op else (f"op {refusal.op!r} ({refusal.target})", refusal.op)
        units[unit].append((label, refusal))
    alike: dict[tuple, list[str]] = defaultdict(list)  # (heads, parts, what was refused) -> modules refused so
    for unit, members in units.items():
        heads = neighbours.heads_near([neighbours.ops[refusal.op] for _, refusal in members if refusal.op in neighbours.ops])
        by_dim: dict[tuple[str, int, int], list[str]] = defaultdict(list)
        for label, refusal in members:
            meaning = _PACKED_QKV if neighbours.packs_qkv(refusal) else _DIM_MEANINGS.get((refusal.target, refusal.dim))
            key = (f"{refusal.dim!r}" + (f" ({meaning})" if meaning else ""), refusal.size, refusal.parts)
            if label not in by_dim[key]:
                by_dim[key].append(label)
        parts = members[0][1].parts
        alike[(heads, parts, tuple((key, tuple(labels)) for key, labels in by_dim.items()))].append(unit)
    lines = []
    for (heads, parts, by_dim), modules in alike.items():
        named = ", ".join(modules[:_MAX_MODULES]) + (f" and {len(modules) - _MAX_MODULES} more" if len(modules) > _MAX_MODULES else "")
        kind = "module" if len(modules) == 1 else "modules"
        if heads is not None:
            kind = f"attention {kind}"
            named += f" ({heads} heads{f', which {parts} parts do not divide' if heads % parts else ''})"
        splits = "; ".join(f"{', '.join(labels)} by dim {dim} of size {size} ({count} parts)" for (dim, size, count), labels in by_dim)
        lines.append(f"{kind} {named}: {splits}")
    return lines, {heads for heads, _, _ in alike if heads is not None}


class _Neighbours:
    """Producers and consumers of the captured graph's tensors, to find an op's module and attention."""

    def __init__(self, graph: Graph) -> None:
        self.ops = {op.name: op for op in graph.ops}
        self.producers = {output.name: op for op in graph.ops for output in op.outputs}
        self.consumers: dict[str, list[Op]] = defaultdict(list)
        for op in graph.ops:
            for piece in op.tensor_inputs:
                self.consumers[piece.name].append(op)

    def packs_qkv(self, refusal: Refusal) -> bool:
        """Whether ``refusal`` is the unflatten of a packed q/k/v projection into its 3 parts that the
        capture did not take apart (it does so for nn.MultiheadAttention's in_proj, see ``capture.packed``)."""
        op = self.ops.get(refusal.op)
        if op is None or refusal.target != "aten.unflatten.int" or refusal.size != 3 or not op.tensor_inputs:
            return False
        producer = self.producers.get(op.tensor_inputs[0].name)
        return producer is not None and producer.target == "aten.linear.default"

    def unit_and_label(self, op: Op) -> tuple[str, str]:
        """The module the op belongs to (``blocks.0.attn``) and its label there (``q_proj``).

        An op with parameters belongs to its parameters' module's parent; one without, to that of
        the nearest op upstream that has parameters (``view after q_proj``: alike in every layer).
        """
        module, label, upstream = _module_of(op), None, op
        for _ in range(_SEARCH_DEPTH if module is None else 0):
            inputs = [piece for piece in upstream.tensor_inputs if piece.name in self.producers]
            if not inputs:
                break
            upstream = self.producers[inputs[0].name]
            module = _module_of(upstream)
            if module is not None:
                label = f"{op.target.split('.')[1]} after {module.rpartition('.')[2]}"
                break
        if module is None:
            return f"op {op.name!r} ({op.target})", op.name
        parent, _, leaf = module.rpartition(".")
        return parent or module, label or leaf

    def heads_near(self, ops: list[Op]) -> int | None:
        """Heads of the attention op next to ``ops``, reached through ops without parameters, downstream
        (q_proj -> view -> transpose -> attention) or upstream (out_proj <- reshape <- transpose <- attention)."""
        frontier, seen = ops, {op.name for op in ops}
        for _ in range(_SEARCH_DEPTH):
            following = []
            for op in frontier:
                if op.target == ATTENTION:
                    return op.tensor_inputs[0].shape[1]  # query (B, heads, T, head size)
                near = [self.producers[piece.name] for piece in op.tensor_inputs if piece.name in self.producers]
                near += [consumer for output in op.outputs for consumer in self.consumers[output.name]]
                following += [item for item in near if item.name not in seen and _module_of(item) is None]
                seen.update(item.name for item in near)
            frontier = following
        return None


def _module_of(op: Op) -> str | None:
    """The module of the op's first parameter (``blocks.0.attn.q_proj`` for ``...q_proj.weight``)."""
    for piece in op.tensor_inputs:
        if piece.tensor.role == "parameter" and piece.tensor.state_key:
            return piece.tensor.state_key.rpartition(".")[0] or piece.tensor.state_key
    return None


def _union_size(boxes: list[IndexMask]) -> int:
    """Elements in the union of index boxes (cells cut by every box boundary; boxes are few)."""
    if len(boxes) == 1:
        return math.prod(boxes[0].shape)
    cuts = []
    for dim in range(len(boxes[0].ranges)):
        points = sorted({point for box in boxes for point in box.ranges[dim]})
        cuts.append(list(zip(points, points[1:])))
    total = 0
    for cell in product(*cuts):
        if any(all(start <= low and high <= stop for (low, high), (start, stop) in zip(cell, box.ranges)) for box in boxes):
            total += math.prod(high - low for low, high in cell)
    return total


def _and(values: Sequence[int]) -> str:
    text = [str(value) for value in values]
    return text[0] if len(text) == 1 else ", ".join(text[:-1]) + " and " + text[-1]
