"""Graph: the captured model as PTensors and ops, plus the plan made on it (pieces, devices, order)."""

from __future__ import annotations

import copy

import torch

from lightning_nnscaler.ir.errors import NnScalerError
from lightning_nnscaler.ir.op import Op
from lightning_nnscaler.ir.tensor import PTensor


class GraphError(NnScalerError, ValueError):
    """A lookup or edit of the graph that does not fit it."""


class Graph:
    """A dataflow graph of ops over logical tensors.

    The IR objects inside are frozen; the graph is the one mutable container, changed only by the
    primitives (``op_trans``, ``op_assign``, ``op_order``). Ops are kept in a topological order of
    their data dependencies; a partitioned op's pieces take its place in that order.

    Ops are linked in order by name (each op's predecessor and successor), so looking up an op costs
    O(1) (a name index) and replacing one O(its replacements), not O(graph) nor O(pieces of its origin):
    plans of 100k pieces stay fast.

    Attributes:
        tensors: Every PTensor by name.
        ops: The ops, topologically ordered (a tuple; edit with the primitives, ``add_op`` or by
            assigning a new sequence).
        inputs: Names of the graph's input tensors (parameters, buffers, constants, user inputs).
        outputs: Names of the tensors the graph returns.
        order_edges: Happens-before edges ``(before, after)`` between op names, from ``op_order``.
        constant_values: Values of lifted constant tensors (kept out of the text form).
        buffer_updates: Buffers the step writes (``self.ema.mul_(0.9)``, BatchNorm's running statistics):
            buffer input name -> the tensor holding its new value, written back after the step.
    """

    def __init__(
        self,
        tensors: dict[str, PTensor] | None = None,
        ops: list[Op] | tuple[Op, ...] = (),
        inputs: list[str] | None = None,
        outputs: list[str] | None = None,
        order_edges: list[tuple[str, str]] | None = None,
        constant_values: dict[str, torch.Tensor] | None = None,
        buffer_updates: dict[str, str] | None = None,
    ) -> None:
        self.tensors: dict[str, PTensor] = tensors if tensors is not None else {}
        self.inputs: list[str] = inputs if inputs is not None else []
        self.outputs: list[str] = outputs if outputs is not None else []
        self.order_edges: list[tuple[str, str]] = order_edges if order_edges is not None else []
        self.constant_values: dict[str, torch.Tensor] = constant_values if constant_values is not None else {}
        self.buffer_updates: dict[str, str] = buffer_updates if buffer_updates is not None else {}
        self.ops = ops

    @property
    def ops(self) -> tuple[Op, ...]:
        """The ops in order."""
        if self._flat is None:
            ordered, name = [], self._next[None]
            while name is not None:
                ordered.append(self._by_name[name])
                name = self._next[name]
            self._flat = tuple(ordered)
        return self._flat

    @ops.setter
    def ops(self, ops: list[Op] | tuple[Op, ...]) -> None:
        names: list[str | None] = [None, *(op.name for op in ops), None]
        # Beside each op's name, the names before and after it; None stands for the start and the end.
        self._next: dict[str | None, str | None] = dict(zip(names[:-1], names[1:]))
        self._previous: dict[str | None, str | None] = dict(zip(names[1:], names[:-1]))
        self._by_name: dict[str, Op] = {op.name: op for op in ops}
        self._flat: tuple[Op, ...] | None = None
        self._ordered_under: tuple[tuple[str, str], ...] | None = None  # see mark_dependency_order

    def add_op(self, op: Op) -> None:
        """Append an op at the end of the order."""
        self._link(self._previous[None], [op.name], None)
        self._by_name[op.name] = op
        self._flat = None
        self._ordered_under = None

    def _link(self, before: str | None, names: list[str], after: str | None) -> None:
        """Chain ``names`` in order between ``before`` and ``after`` (None: the start, the end)."""
        chain = [before, *names, after]
        for first, second in zip(chain[:-1], chain[1:]):
            self._next[first] = second
            self._previous[second] = first

    def op(self, op: Op | str) -> Op:
        """The graph's current op named like ``op`` (an Op handle may be stale after an edit)."""
        name = op if isinstance(op, str) else op.name
        found = self._by_name.get(name)
        if found is not None:
            return found
        pieces = [candidate.name for candidate in self.ops if candidate.origin == name]
        hint = f"; it was partitioned into {pieces[:4]}{'...' if len(pieces) > 4 else ''}" if pieces else ""
        raise GraphError(f"no op named {name!r} in the graph{hint}")

    def index_of(self, op: Op | str) -> int:
        """Position of an op in the graph's order."""
        name = op if isinstance(op, str) else op.name
        for index, candidate in enumerate(self.ops):
            if candidate.name == name:
                return index
        raise GraphError(f"no op named {name!r} in the graph")

    def replace_op(self, op: Op | str, replacements: list[Op]) -> None:
        """Put ``replacements`` where ``op`` was."""
        name = self.op(op).name
        if len(replacements) == 1 and replacements[0].name == name:  # the op changed in place (op_assign): same links
            self._by_name[name] = replacements[0]
            self._flat = None
            self._ordered_under = None
            return
        del self._by_name[name]
        before, after = self._previous.pop(name), self._next.pop(name)
        self._link(before, [replacement.name for replacement in replacements], after)
        for replacement in replacements:
            self._by_name[replacement.name] = replacement
        self._flat = None
        self._ordered_under = None

    def mark_dependency_order(self) -> None:
        """Record that ``ops`` is a topological order of the data dependencies and the current ``order_edges`` (as
        ``stable_topological_order`` returns it), so that ``validate_plan`` needs no cycle search. Any edit of the ops
        forgets it; changed order edges void it."""
        self._ordered_under = tuple(self.order_edges)

    @property
    def in_dependency_order(self) -> bool:
        """Whether ``mark_dependency_order`` still holds: no op edited since, the same order edges."""
        return self._ordered_under is not None and tuple(self.order_edges) == self._ordered_under

    def producers(self, tensor_name: str) -> list[Op]:
        """Ops that write a piece of the tensor."""
        return [op for op in self.ops if any(out.name == tensor_name for out in op.outputs)]

    def consumers(self, tensor_name: str) -> list[Op]:
        """Ops that read a piece of the tensor."""
        return [op for op in self.ops if any(piece.name == tensor_name for piece in op.tensor_inputs)]

    @property
    def parameters(self) -> list[PTensor]:
        """Parameter tensors, in input order."""
        return [self.tensors[name] for name in self.inputs if self.tensors[name].role == "parameter"]

    @property
    def user_inputs(self) -> list[PTensor]:
        """Tensors the caller passes in, in order."""
        return [self.tensors[name] for name in self.inputs if self.tensors[name].role == "input"]

    @property
    def devices(self) -> list[int]:
        """Devices that ops are assigned to, sorted."""
        return sorted({op.device for op in self.ops if op.device is not None})

    def copy(self) -> Graph:
        """An independent copy (IR objects are shared: they are frozen; constant values are shared)."""
        return Graph(
            tensors=dict(self.tensors),
            ops=list(self.ops),
            inputs=list(self.inputs),
            outputs=list(self.outputs),
            order_edges=list(self.order_edges),
            constant_values=copy.copy(self.constant_values),
            buffer_updates=dict(self.buffer_updates),
        )

    def take_contents(self, other: Graph) -> None:
        """Make this graph hold ``other``'s contents (used to commit an edit made on a copy)."""
        self.__dict__.update(other.__dict__)

    def __str__(self) -> str:
        from lightning_nnscaler.ir.printer import format_graph

        return format_graph(self)

    @classmethod
    def from_text(cls, text: str) -> Graph:
        """Parse the text form that ``str(graph)`` writes."""
        from lightning_nnscaler.ir.printer import parse_graph

        return parse_graph(text)
