"""Per-rank programs: the ordered actions one rank runs, after dependency materialization.

Every action carries the global ``position`` it was placed at (a position in the planned graph's
op order); each rank runs its actions sorted by position, so blocking receives and collectives
only ever wait for data produced at earlier positions, on every rank alike — no deadlock.

A pipelined plan (ops carry a ``segment``) is cut further: each action belongs to one segment
``(stage, microbatch)`` (or the step's prologue), a rank's actions of one segment become one
function, and the schedule — not the position — orders the segments. A tensor one segment hands
to another is a *boundary* message (``Send``/``Recv`` with ``boundary=True``): the producing
function returns it, the runtime sends it after that segment's forward (to itself when both
segments are on one rank) and sends its gradient back after the consumer's backward.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from lightning_nnscaler.ir.box import Box
from lightning_nnscaler.ir.op import Op
from lightning_nnscaler.ir.tensor import IndexMask, VTensor

Segment = tuple[int, int] | None


@dataclass(frozen=True)
class Compute:
    """Run ``op``; its input pieces are the variables ``input_vars``, its outputs ``output_vars``."""

    position: float
    op: Op
    input_vars: tuple[str, ...]
    output_vars: tuple[str, ...]

    @property
    def segment(self) -> Segment:
        """The op's segment."""
        return self.op.segment


@dataclass(frozen=True)
class Send:
    """Send ``source_var[region]`` to ``dst`` (asynchronous)."""

    position: float
    source_var: str
    region: tuple[slice, ...]
    dst: int
    tag: int
    segment: Segment = None
    boundary: bool = False  # between segments: the runtime sends it after the segment's forward
    gradient: bool = True  # a boundary message whose gradient comes back (not from a no-grad segment, floating)


@dataclass(frozen=True)
class Recv:
    """Receive a tensor of ``shape``/``dtype`` from ``src`` into ``var`` (blocking)."""

    position: float
    var: str
    shape: tuple[int, ...]
    dtype: str
    src: int
    tag: int
    segment: Segment = None
    boundary: bool = False  # between segments: the runtime receives it before the segment's forward
    gradient: bool = True  # a boundary message whose gradient goes back (not from a no-grad segment, floating)


@dataclass(frozen=True)
class Fragment:
    """Part of a piece being assembled: ``var[source_region]`` lands at ``target_region``."""

    var: str
    source_region: tuple[slice, ...]
    target_region: tuple[slice, ...]
    whole: bool  # the fragment is the entire target piece


@dataclass(frozen=True)
class Assemble:
    """Build ``var`` (the piece ``piece``) by placing and adding fragments (value parts add up)."""

    position: float
    var: str
    piece: VTensor
    fragments: tuple[Fragment, ...]
    zeros: bool = False  # a value part k > 0 of a whole tensor: exact zeros, no data needed
    segment: Segment = None


@dataclass(frozen=True)
class Collective:
    """A collective among ``ranks`` on ``source_var``, producing ``var``."""

    position: float
    kind: str  # all_reduce | all_gather | reduce_scatter | all_to_all | broadcast
    var: str
    source_var: str  # "None" on the ranks of a broadcast other than its source
    ranks: tuple[int, ...]
    dim: int = 0
    second_dim: int = 0
    bytes_per_device: int = 0  # what this device sends in the collective (for explain)
    segment: Segment = None
    src: int = -1  # broadcast: the rank whose tensor every rank gets
    shape: tuple[int, ...] = ()  # broadcast: the tensor's shape and dtype (the other ranks allocate it)
    dtype: str = ""


Action = Compute | Send | Recv | Assemble | Collective


def reads(action: Action) -> list[str]:
    """The variables ``action`` reads."""
    if isinstance(action, Compute):
        return list(action.input_vars)
    if isinstance(action, Collective) and action.source_var == "None":
        return []
    if isinstance(action, (Send, Collective)):
        return [action.source_var]
    if isinstance(action, Assemble):
        return [fragment.var for fragment in action.fragments]
    return []


def writes(action: Action) -> list[str]:
    """The variables ``action`` defines."""
    if isinstance(action, Compute):
        return list(action.output_vars)
    if isinstance(action, (Assemble, Recv, Collective)):
        return [action.var]
    return []


@dataclass(frozen=True)
class LocalTensor:
    """A graph input piece this rank holds: ``var`` is tensor ``name`` restricted to ``box``."""

    var: str
    name: str
    state_key: str | None
    box: Box
    role: str


@dataclass(frozen=True)
class RankOutput:
    """A graph output piece this rank computes; ``seed`` marks the replica that starts backward."""

    name: str
    var: str
    piece: VTensor
    seed: bool
    segment: Segment = None


@dataclass
class RankProgram:
    """What one rank runs: its graph-input pieces, ordered actions and output pieces."""

    rank: int
    inputs: list[LocalTensor] = field(default_factory=list)
    actions: list[Action] = field(default_factory=list)
    outputs: list[RankOutput] = field(default_factory=list)


@dataclass(frozen=True)
class GradientGroup:
    """Ranks holding the same box of a parameter: their gradients are summed after backward."""

    name: str
    state_key: str
    box: Box
    ranks: tuple[int, ...]


@dataclass
class Program:
    """The materialized plan: one program per rank plus the gradient reduction groups."""

    world_size: int
    ranks: list[RankProgram]
    gradient_groups: list[GradientGroup]
    loss: str | None = None
    """The graph output backward starts from (the graph's first output); the others are values summed over the ranks."""
    buffer_updates: dict[str, str] = field(default_factory=dict)
    """New buffer values (``Graph.buffer_updates``): tensor name -> the buffer's state_dict key. Each rank writes
    its own pieces into the buffer boxes it holds after the step (never summed: per replica, as under ddp)."""
    local_rank: int | None = None
    """None: every rank's program is whole. Else only this rank's is (a rank-local materialization, ``materialize(rank=)``);
    of the other ranks' programs only their messages with it, their collectives, outputs and held inputs are whole."""

    @functools.cached_property
    def pipelined(self) -> bool:
        """Whether the actions belong to segments that a schedule runs (see the module docstring); computed once
        (codegen asks for each rank, and a plan that does not pipeline has to look at every action to say so)."""
        return any(isinstance(action, Compute) and action.segment is not None for program in self.ranks for action in program.actions)

    @functools.cached_property
    def communication_groups(self) -> list[tuple[int, ...]]:
        """Every rank tuple a collective or gradient reduction uses, sorted (for group creation)."""
        groups = {group.ranks for group in self.gradient_groups if len(group.ranks) > 1}
        for program in self.ranks:
            groups.update(action.ranks for action in program.actions if isinstance(action, Collective))
        return sorted(groups)

    @functools.cached_property
    def value_shapes(self) -> dict[str, tuple[int, ...]]:
        """Whole shape of each graph output besides the loss and the buffers' new values (the logged values every
        rank's code lists); computed once, as every rank's code asks for it."""
        return {
            output.name: output.piece.tensor.shape for program in self.ranks for output in program.outputs
            if self.loss is not None and output.name != self.loss and output.name not in self.buffer_updates
        }


def box_of(mask: IndexMask) -> Box:
    """An index mask as a plain tuple of ranges."""
    return tuple(mask.ranges)
