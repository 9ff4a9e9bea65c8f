"""Running a rank module: its ``SCHEDULE`` of F/B/W actions over segments, in that order.

The generated module (``codegen.segments``) gives one function per segment and the boundary
messages of each; a plan that is not pipelined has one segment, run ``["0F0", "0B0"]``. This runner:

- runs ``prologue`` once (no gradients; a module without one has nothing to run before its
  segments), then each action of ``SCHEDULE`` in order;
- ``F(s, m)``: receives the segment's boundary inputs (from itself when the producing segment is
  on this rank), makes each one whose gradient goes back a leaf that requires grad — so the
  segment's backward stops at its own inputs —, runs the segment function with a fresh token and
  sends (asynchronously) the boundary tensors it returns; what backward needs stays stashed under
  ``(s, m)``. A segment the schedule never runs backward (3F1B's recycling passes) runs under
  ``no_grad`` and stashes nothing;
- ``B(s, m)``: receives the gradients of the segment's sent tensors that carry one (and releases the
  copies of those sent tensors: the peer received each before it answered), runs autograd
  backward through that segment only (its loss pieces seeded with the loss scale, its token chain
  included, so inline tensor-parallel communication replays in reverse), and sends each boundary
  input's gradient back to its producer (zeros when it got none). Whether a message's gradient
  travels back is fixed in the generated tables (floating, and not from a no-grad segment), so both
  ends agree;
- with ``W`` actions (zero-bubble), ``B`` is the input half of the backward alone (``I``) and
  ``W(s, m)`` its weight half (``runtime.split_backward``): I keeps the gradients at the nodes where
  the weight paths leave the input path, and W starts from them, never from the root again, so that
  I and W together run each backward op once.

Replicated gradients: the reducer accumulates locally over the step's backward actions and sums once,
its buckets starting during the rank's last backward action (``GradientReducer`` as with one segment).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType

import torch

from lightning_nnscaler.ir.op import PROLOGUE
from lightning_nnscaler.runtime.autograd_comm import BACKWARD_TAG_OFFSET
from lightning_nnscaler.runtime.comm import Communicator
from lightning_nnscaler.runtime.split_backward import WeightPass, input_gradients

_ACTION = re.compile(r"(\d+)([FBW])(\d+)")


@dataclass
class _Stash:
    """What a segment's forward left for its backward."""

    received: dict[int, torch.Tensor]
    sent: dict[int, torch.Tensor]
    seeds: list[torch.Tensor]
    token: torch.Tensor


@dataclass
class PipelineRun:
    """One step of a rank's module (its ``SCHEDULE``, one segment or a pipeline's) on one rank.

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
    stash: dict[tuple[int, int], _Stash] = field(default_factory=dict)
    deferred: dict[tuple[int, int], WeightPass] = field(default_factory=dict)
    """Zero-bubble: what each segment's input-only B left for its W."""
    local_activations: dict[int, torch.Tensor] = field(default_factory=dict)
    local_gradients: dict[int, torch.Tensor] = field(default_factory=dict)
    shared: dict[str, torch.Tensor] = field(default_factory=dict)
    seeds: list[torch.Tensor] = field(default_factory=list)
    values: list[tuple[str, tuple, torch.Tensor]] = field(default_factory=list)
    """Counted pieces of the graph outputs besides the loss (``VALUE_PIECES``): ``(graph output, box, value)``."""
    buffer_values: list[tuple[str, tuple, torch.Tensor]] = field(default_factory=list)
    """This rank's pieces of the buffers' new values (``BUFFER_PIECES``): ``(state_dict key, box, value)``."""
    with_backward: set[tuple[int, int]] = field(default_factory=set)
    executed: list[tuple[str, float, float]] = field(default_factory=list)
    """``(action, start, end)`` in ``time.perf_counter`` seconds, for each action run (when ``trace``)."""

    def actions(self, backward: bool) -> list[tuple[str, int, int]]:
        """``SCHEDULE`` as ``(kind, stage, microbatch)``; forward actions only when not ``backward``."""
        parsed = []
        for text in self.module.SCHEDULE:
            stage, kind, microbatch = _ACTION.fullmatch(text).groups()
            if backward or kind == "F":
                parsed.append((kind, int(stage), int(microbatch)))
        return parsed

    def run(
        self, *, backward: bool, loss_scale: float | torch.Tensor, before_last_backward: Callable[[], None] | None = None,
        after_last_forward: Callable[[], None] | None = None, trace: bool = False,
    ) -> list[torch.Tensor]:
        """Run the prologue and every action; returns the seeded loss pieces (detached).

        ``after_last_forward()`` is called right after the rank's last forward action, when every seed
        and value is known; ``before_last_backward()`` right before the last action that accumulates
        parameter gradients (the reducer's buckets start during it).
        """
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
        actions = self.actions(backward)
        self.with_backward = {(stage, microbatch) for kind, stage, microbatch in actions if kind != "F"}
        accumulating = "W" if any(kind == "W" for kind, _, _ in actions) else "B"
        last = max((index for index, (kind, _, _) in enumerate(actions) if kind == accumulating), default=None)
        last_forward = max((index for index, (kind, _, _) in enumerate(actions) if kind == "F"), default=-1)
        if last_forward < 0 and after_last_forward is not None:
            after_last_forward()
        for index, (kind, stage, microbatch) in enumerate(actions):
            if index == last and before_last_backward is not None:
                before_last_backward()
            start = time.perf_counter() if trace else 0.0
            if kind == "F":
                self.forward(stage, microbatch, backward)
            elif kind == "B":
                self.backward(stage, microbatch, loss_scale, input_gradients_only=accumulating == "W")
            else:
                self.weights(stage, microbatch)
            if trace:
                self.executed.append((f"{stage}{kind}{microbatch}", start, time.perf_counter()))
            if index == last_forward and after_last_forward is not None:
                after_last_forward()
        return self.seeds

    def forward(self, stage: int, microbatch: int, backward: bool) -> None:
        """F: receive the boundary inputs, run the segment, send its boundary outputs, stash for B."""
        segment = (stage, microbatch)
        backward = backward and segment in self.with_backward
        received = {}
        for tag, src, shape, dtype, gradient in self.module.BOUNDARY_IN.get(segment, []):
            if src == self.rank:
                tensor = self.local_activations.pop(tag)
            else:
                tensor = self.communicator.recv(shape, dtype, src, tag)
                self._release_after((src, tag, False))
            if backward and gradient:
                tensor = tensor.detach().requires_grad_()
            received[tag] = tensor
        function = self.module.SEGMENTS.get(segment)
        if function is None:
            return  # a segment with no ops on this rank (e.g. a stage whose work its peers do)
        token = torch.zeros((), device=self.device, requires_grad=backward)
        with torch.set_grad_enabled(backward):
            sent, outputs, token = function(self.held, self.shared, received, self.communicator, token)
        for tag, dst, _ in self.module.BOUNDARY_OUT.get(segment, []):
            if dst == self.rank:
                self.local_activations[tag] = sent[tag]
            else:
                self.communicator.send(sent[tag], dst, tag)
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

    def backward(self, stage: int, microbatch: int, loss_scale: float | torch.Tensor, *, input_gradients_only: bool) -> None:
        """B: gradients of the sent tensors in, backward through the segment, input gradients out."""
        segment = (stage, microbatch)
        if segment not in self.stash:
            return  # no ops on this rank
        entry = self.stash.pop(segment)
        roots, gradients = [], []
        for tag, dst, gradient in self.module.BOUNDARY_OUT.get(segment, []):
            value = entry.sent[tag]
            if not gradient:
                continue
            if dst == self.rank:
                gradient = self.local_gradients.pop(tag)
            else:
                gradient = self.communicator.recv(value.shape, value.dtype, dst, tag + BACKWARD_TAG_OFFSET)
                self._release_after((dst, tag, True))
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
        for tag, src, shape, dtype, gradient in self.module.BOUNDARY_IN.get(segment, []):
            tensor = entry.received[tag]
            if not gradient:
                continue
            gradient = input_gradients_by_id.get(id(tensor))
            gradient = torch.zeros(shape, dtype=dtype, device=self.device) if gradient is None else gradient
            if src == self.rank:
                self.local_gradients[tag] = gradient
            else:
                self.communicator.send(gradient, src, tag + BACKWARD_TAG_OFFSET)

    def _release_after(self, received: tuple[int, int, bool]) -> None:
        """Drop the copies of the sent messages that the receipt of ``received`` proves taken (the module's ``RELEASES``)."""
        for dst, tag, gradient in getattr(self.module, "RELEASES", {}).get(received, ()):
            self.communicator.release_send(dst, tag + BACKWARD_TAG_OFFSET if gradient else tag)

    def weights(self, stage: int, microbatch: int) -> None:
        """W: accumulate the segment's weight gradients from the gradients its input-only B kept."""
        deferred = self.deferred.pop((stage, microbatch), None)
        if deferred is not None:
            deferred.accumulate()
