"""Running a rank module's ``PROGRAM``: one handler per action kind, the actions in their only order.

The generated module (``codegen.segments``) gives one function per segment and the boundary
messages of each; ``PROGRAM`` is the rank's part of the plan's ``program.Program``. This runner runs
``prologue`` once (no gradients; a module without one has nothing to run before its segments), then
dispatches each action:

- ``RECV_F`` from a peer: the segment's boundary inputs from that peer. ``F(s, m)``: takes the inputs
  handed over in memory by its own earlier segments, makes each input whose gradient goes back a leaf
  that requires grad — so the segment's backward stops at its own inputs —, runs the segment function
  with a fresh token and keeps what backward needs under ``(s, m)``; ``SEND_F`` to a peer sends
  (asynchronously) the outputs that go to it. A segment the program never runs backward (3F1B's
  recycling passes) runs under ``no_grad`` and keeps nothing;
- ``RECV_B`` from a peer: the gradients of the segment's outputs sent there (and releases the copies of
  the sent messages the receipt proves taken, ``RELEASES``). ``B(s, m)``: autograd backward through that
  segment only (its loss pieces seeded with the loss scale, its token chain included, so inline
  tensor-parallel communication replays in reverse); ``SEND_B`` to a peer sends the gradients of the inputs
  that came from it (zeros when none reached them). Whether a message's gradient travels back is fixed in
  the generated tables (floating, and not from a no-grad segment), so both ends agree;
- with ``W`` actions (zero-bubble), ``B`` is the input half of the backward alone and ``W(s, m)`` its
  weight half (``runtime.split_backward``): B keeps the gradients at the nodes where the weight paths
  leave the input path, and W starts from them, so that B and W together run each backward op once;
- ``LOSS``, ``REDUCE b<k>``, ``GATHER b<k>``, ``FREE b<k>`` and ``STEP`` go to the executor's handlers
  (``StepHandlers``): the loss sum, the gradient buckets, ZeRO's gathers.

Every action run is recorded (``executed``: its text, and its start and end when ``trace``) so that a test
can hold the run against the simulator's sequence of the same program.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from lightning_nnscaler.ir.op import PROLOGUE
from lightning_nnscaler.program import Action, ActionKind, last_accumulating
from lightning_nnscaler.runtime.autograd_comm import BACKWARD_TAG_OFFSET
from lightning_nnscaler.runtime.comm import Communicator
from lightning_nnscaler.runtime.split_backward import WeightPass, input_gradients

Segment = tuple[int, int]


def module_actions(module: ModuleType) -> list[Action]:
    """The rank's ``PROGRAM`` as actions (each line holds several, joined by commas)."""
    return [Action.parse(text) for line in module.PROGRAM for text in line.split(",")]


@dataclass
class StepHandlers:
    """What the executor does at the step's actions that are not a segment's (``None``: nothing to do).

    ``before_last_backward()`` runs right before the last action that accumulates parameter gradients
    (the reducer's buckets start during it).
    """

    loss: Callable[[], None] | None = None
    reduce: Callable[[int], None] | None = None
    gather: Callable[[int], None] | None = None
    free: Callable[[int], None] | None = None
    before_last_backward: Callable[[], None] | None = None


@dataclass
class _Stash:
    """What a segment's forward left for its backward."""

    received: dict[int, torch.Tensor]
    sent: dict[int, torch.Tensor]
    seeds: list[torch.Tensor]
    token: torch.Tensor


@dataclass
class PipelineRun:
    """One step of a rank's module (its ``PROGRAM``) on one rank.

    Args:
        module: The rank's generated module.
        rank: This rank.
        communicator: Its communicator.
        held: The rank's held tensors by variable (pieces, constants, the batch boxes).
        parameters: The parameters whose gradients ``W`` accumulates.
        device: Where new tensors go.
    """

    module: ModuleType
    rank: int
    communicator: Communicator
    held: dict[str, torch.Tensor]
    parameters: list[torch.Tensor]
    device: torch.device
    stash: dict[Segment, _Stash] = field(default_factory=dict)
    deferred: dict[Segment, WeightPass] = field(default_factory=dict)
    """Zero-bubble: what each segment's input-only B left for its W."""
    received: dict[Segment, dict[int, torch.Tensor]] = field(default_factory=dict)
    """Boundary inputs received for a segment whose F has not run yet."""
    outgoing: dict[Segment, dict[int, torch.Tensor]] = field(default_factory=dict)
    """A segment's boundary outputs (by tag) waiting for their SEND_F."""
    output_gradients: dict[Segment, dict[int, torch.Tensor]] = field(default_factory=dict)
    """Gradients of a segment's sent outputs, received for its B."""
    input_gradients: dict[Segment, dict[int, torch.Tensor]] = field(default_factory=dict)
    """Gradients of a segment's received inputs, waiting for their SEND_B."""
    local_activations: dict[int, torch.Tensor] = field(default_factory=dict)
    local_gradients: dict[int, torch.Tensor] = field(default_factory=dict)
    shared: dict[str, torch.Tensor] = field(default_factory=dict)
    seeds: list[torch.Tensor] = field(default_factory=list)
    values: list[tuple[str, tuple, torch.Tensor]] = field(default_factory=list)
    """Counted pieces of the graph outputs besides the loss (``VALUE_PIECES``): ``(graph output, box, value)``."""
    buffer_values: list[tuple[str, tuple, torch.Tensor]] = field(default_factory=list)
    """This rank's pieces of the buffers' new values (``BUFFER_PIECES``): ``(state_dict key, box, value)``."""
    with_backward: set[Segment] = field(default_factory=set)
    executed: list[tuple[str, float, float]] = field(default_factory=list)
    """``(action, start, end)`` of each action run, in order (times in ``time.perf_counter`` seconds when ``trace``, else 0)."""
    trace: bool = False
    segments: dict[Segment, Callable[..., Any]] | None = None
    """The segment functions to run (``runtime.compiled``); None: the module's ``SEGMENTS``."""

    def record(self, text: str, start: float = 0.0) -> None:
        """Add ``text`` to ``executed`` (the reducer reports the buckets it starts here)."""
        self.executed.append((text, start, time.perf_counter() if self.trace else 0.0))

    def run(self, actions: Sequence[Action], *, backward: bool, loss_scale: float | torch.Tensor, handlers: StepHandlers) -> list[torch.Tensor]:
        """Run the prologue and ``actions`` up to ``STEP`` (forward and loss actions only unless ``backward``);
        returns the seeded loss pieces (detached)."""
        prologue = getattr(self.module, "prologue", None)
        if prologue is not None:
            with torch.no_grad():
                self.shared, _ = prologue(self.held, self.communicator, torch.zeros((), device=self.device))
        self.values = [
            (name, box, self.shared[var]) for name, var, box, counted, segment in getattr(self.module, "VALUE_PIECES", ())
            if counted and tuple(segment) == PROLOGUE
        ]
        self.buffer_values = [
            (key, box, self.shared[var]) for _, var, box, key, segment in getattr(self.module, "BUFFER_PIECES", ()) if tuple(segment) == PROLOGUE
        ]
        if not backward:
            actions = forward_actions(actions)
        step = next((index for index, action in enumerate(actions) if action.kind is ActionKind.STEP), len(actions))
        actions = actions[:step]
        self.with_backward = {(action.stage, action.microbatch) for action in actions if action.kind is ActionKind.BACKWARD}
        split = any(action.kind is ActionKind.WEIGHT for action in actions)
        last = last_accumulating(actions) if backward else None
        for index, action in enumerate(actions):
            if index == last and handlers.before_last_backward is not None:
                handlers.before_last_backward()
            start = time.perf_counter() if self.trace else 0.0
            if action.kind is not ActionKind.REDUCE:  # the reducer records a bucket when its sum starts (maybe during B)
                self.record(str(action), start)
            self._dispatch(action, backward, loss_scale, split, handlers)
            if self.trace and action.kind is not ActionKind.REDUCE:
                self.executed[-1] = (str(action), start, time.perf_counter())
        return self.seeds

    def _dispatch(self, action: Action, backward: bool, loss_scale: float | torch.Tensor, split: bool, handlers: StepHandlers) -> None:
        kind, segment = action.kind, (action.stage, action.microbatch)
        if kind is ActionKind.RECV_F:
            self.receive_inputs(segment, action.peer)
        elif kind is ActionKind.FORWARD:
            self.forward(segment, backward)
        elif kind is ActionKind.SEND_F:
            self.send_outputs(segment, action.peer)
        elif kind is ActionKind.RECV_B:
            self.receive_output_gradients(segment, action.peer)
        elif kind is ActionKind.BACKWARD:
            self.backward(segment, loss_scale, input_gradients_only=split)
        elif kind is ActionKind.SEND_B:
            self.send_input_gradients(segment, action.peer)
        elif kind is ActionKind.WEIGHT:
            self.weights(segment)
        else:
            handler = {ActionKind.LOSS: handlers.loss, ActionKind.REDUCE: handlers.reduce, ActionKind.GATHER: handlers.gather,
                       ActionKind.FREE: handlers.free}.get(kind)
            if handler is not None:
                handler() if kind is ActionKind.LOSS else handler(action.bucket)

    def receive_inputs(self, segment: Segment, peer: int) -> None:
        """RECV_F: the segment's boundary inputs from ``peer``, in table order."""
        received = self.received.setdefault(segment, {})
        for tag, src, shape, dtype, _ in self.module.BOUNDARY_IN.get(segment, []):
            if src == peer:
                received[tag] = self.communicator.recv(shape, dtype, src, tag)
                self._release_after((src, tag, False))

    def forward(self, segment: Segment, backward: bool) -> None:
        """F: the inputs handed over in memory, the segment function, its outputs kept for SEND_F (or handed over), stash for B."""
        backward = backward and segment in self.with_backward
        arrived = self.received.pop(segment, {})
        received = {}
        for tag, src, _, _, gradient in self.module.BOUNDARY_IN.get(segment, []):
            tensor = self.local_activations.pop(tag) if src == self.rank else arrived[tag]
            received[tag] = tensor.detach().requires_grad_() if backward and gradient else tensor
        function = (self.module.SEGMENTS if self.segments is None else self.segments).get(segment)
        if function is None:
            return  # a segment with no ops on this rank (e.g. a stage whose work its peers do)
        token = torch.zeros((), device=self.device, requires_grad=backward)
        with torch.set_grad_enabled(backward):
            sent, outputs, token = function(self.held, self.shared, received, self.communicator, token)
        remote = {}
        for tag, dst, _ in self.module.BOUNDARY_OUT.get(segment, []):
            if dst == self.rank:
                self.local_activations[tag] = sent[tag]
            else:
                remote[tag] = sent[tag]
        if remote:
            self.outgoing[segment] = remote
        seeds = [outputs[name] for name, _, seed, seed_segment in self.module.OUTPUTS if seed and tuple(seed_segment) == segment]
        self.seeds += [seed.detach() for seed in seeds]
        self.values += [
            (name, box, outputs[name].detach()) for name, _, box, counted, value_segment in getattr(self.module, "VALUE_PIECES", ())
            if counted and tuple(value_segment) == segment
        ]
        self.buffer_values += [
            (key, box, outputs[name].detach()) for name, _, box, key, buffer_segment in getattr(self.module, "BUFFER_PIECES", ())
            if tuple(buffer_segment) == segment
        ]
        if backward:
            self.stash[segment] = _Stash(received, sent, seeds, token)

    def send_outputs(self, segment: Segment, peer: int) -> None:
        """SEND_F: the segment's outputs that go to ``peer``, asynchronously."""
        outgoing = self.outgoing.get(segment, {})
        for tag, dst, _ in self.module.BOUNDARY_OUT.get(segment, []):
            if dst == peer:
                self.communicator.send(outgoing.pop(tag), dst, tag)
        if not outgoing:
            self.outgoing.pop(segment, None)

    def receive_output_gradients(self, segment: Segment, peer: int) -> None:
        """RECV_B: the gradients of the segment's outputs sent to ``peer`` (those that carry one)."""
        entry = self.stash.get(segment)
        gradients = self.output_gradients.setdefault(segment, {})
        for tag, dst, gradient in self.module.BOUNDARY_OUT.get(segment, []):
            if dst == peer and gradient and entry is not None:
                value = entry.sent[tag]
                gradients[tag] = self.communicator.recv(value.shape, value.dtype, dst, tag + BACKWARD_TAG_OFFSET)
                self._release_after((dst, tag, True))

    def backward(self, segment: Segment, loss_scale: float | torch.Tensor, *, input_gradients_only: bool) -> None:
        """B: backward through the segment from its outputs' gradients and its loss seeds; its input gradients kept for SEND_B."""
        if segment not in self.stash:
            return  # no ops on this rank
        entry = self.stash.pop(segment)
        arrived = self.output_gradients.pop(segment, {})
        roots, gradients = [], []
        for tag, dst, gradient in self.module.BOUNDARY_OUT.get(segment, []):
            if not gradient:
                continue
            value = entry.sent[tag]
            gradient = self.local_gradients.pop(tag) if dst == self.rank else arrived[tag]
            if value.requires_grad:
                roots.append(value)
                gradients.append(gradient)
        unscaled = not isinstance(loss_scale, torch.Tensor) and loss_scale == 1.0
        for seed in entry.seeds:
            if seed.requires_grad:
                roots.append(seed)
                gradients.append(None if unscaled else torch.ones_like(seed) * loss_scale)
        # Seeding one scalar root: the token's chain replays the segment's inline communication, and
        # no explicit-gradient check runs (its first call imports sympy: seconds, once per process).
        root = entry.token * 0
        for tensor, gradient in zip(roots, gradients):
            root = root + (tensor.sum() if gradient is None else (tensor * gradient).sum())
        leaves = [tensor for tensor in entry.received.values() if tensor.requires_grad]
        if input_gradients_only:
            grads, self.deferred[segment] = input_gradients(root, leaves, self.parameters)
            input_gradients_by_id = dict(zip((id(leaf) for leaf in leaves), grads))
        else:
            root.backward()
            input_gradients_by_id = {id(leaf): leaf.grad for leaf in leaves}
        outgoing = {}
        for tag, src, shape, dtype, gradient in self.module.BOUNDARY_IN.get(segment, []):
            if not gradient:
                continue
            value = input_gradients_by_id.get(id(entry.received[tag]))
            value = torch.zeros(shape, dtype=dtype, device=self.device) if value is None else value
            if src == self.rank:
                self.local_gradients[tag] = value
            else:
                outgoing[tag] = value
        if outgoing:
            self.input_gradients[segment] = outgoing

    def send_input_gradients(self, segment: Segment, peer: int) -> None:
        """SEND_B: the gradients of the segment's inputs that came from ``peer``."""
        outgoing = self.input_gradients.get(segment, {})
        for tag, src, _, _, gradient in self.module.BOUNDARY_IN.get(segment, []):
            if src == peer and gradient and tag in outgoing:
                self.communicator.send(outgoing.pop(tag), src, tag + BACKWARD_TAG_OFFSET)
        if not outgoing:
            self.input_gradients.pop(segment, None)

    def _release_after(self, received: tuple[int, int, bool]) -> None:
        """Drop the copies of the sent messages that the receipt of ``received`` proves taken (the module's ``RELEASES``)."""
        for dst, tag, gradient in getattr(self.module, "RELEASES", {}).get(received, ()):
            self.communicator.release_send(dst, tag + BACKWARD_TAG_OFFSET if gradient else tag)

    def weights(self, segment: Segment) -> None:
        """W: accumulate the segment's weight gradients from the gradients its input-only B kept."""
        deferred = self.deferred.pop(segment, None)
        if deferred is not None:
            deferred.accumulate()


def forward_actions(actions: Sequence[Action]) -> list[Action]:
    """What a forward-only run (evaluation) of ``actions`` does: the forwards, their messages and the loss, and ZeRO-3's
    GATHER / FREE up to the first backward (its forwards' windows; whatever is still gathered then is the caller's
    to free)."""
    forward = (ActionKind.FORWARD, ActionKind.RECV_F, ActionKind.SEND_F, ActionKind.LOSS)
    first_backward = next((index for index, action in enumerate(actions) if action.kind is ActionKind.BACKWARD), len(actions))
    return [
        action for index, action in enumerate(actions)
        if action.kind in forward or (index < first_backward and action.kind in (ActionKind.GATHER, ActionKind.FREE))
    ]
