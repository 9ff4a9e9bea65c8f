"""What a rank does in one step, one ``Action`` at a time (DESIGN.md §9).

The text form follows torch.distributed.pipelining's ``_Action``: ``"1F0"`` is stage 1, forward,
microbatch 0. Communication between segments carries the peer rank and an arrow that points the way
the data flows: ``"0SEND_F3->1"`` (stage 0 sends its output of microbatch 3 to rank 1) and
``"1RECV_F3<-0"`` (stage 1 receives its input of microbatch 3 from rank 0); ``SEND_B``/``RECV_B`` carry
gradients the other way. The stage of a communication action is the stage of the rank that runs it.

The step's other actions name no stage: ``LOSS`` starts the sum of the loss (and logged values) over
the ranks, ``REDUCE b2`` sums the gradients of the rank's bucket 2 (an all-reduce, or under ZeRO a
reduce-scatter onto the owned chunks), ``GATHER b0`` all-gathers ZeRO bucket 0's boxes from their
chunks, ``FREE b0`` drops them again (ZeRO-3 at rest), ``STEP`` is the optimizer step.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class ActionKind(str, enum.Enum):
    """What an action does; the value is its text in the compact form."""

    FORWARD = "F"  # run the segment forward and stash what its backward needs
    BACKWARD = "B"  # backward through the segment (its input-gradient half when the schedule has W actions)
    WEIGHT = "W"  # the weight-gradient half of B (zero-bubble schedules)
    SEND_F = "SEND_F"  # send a stage's output activations to a rank holding a later stage
    RECV_F = "RECV_F"  # receive a stage's input activations from a rank holding an earlier stage
    SEND_B = "SEND_B"  # send a stage's input gradients back to the rank that sent the activations
    RECV_B = "RECV_B"  # receive a stage's output gradients from the rank it sent activations to
    LOSS = "LOSS"  # start summing the loss pieces (and logged values) over every rank
    REDUCE = "REDUCE"  # sum a gradient bucket over its ranks (ZeRO: reduce-scatter it onto the chunks)
    GATHER = "GATHER"  # ZeRO: all-gather a bucket's boxes from the owned chunks
    FREE = "FREE"  # ZeRO-3: drop a bucket's gathered boxes
    STEP = "STEP"  # the optimizer step

    @property
    def is_compute(self) -> bool:
        """True for F, B and W."""
        return self._value_ in _COMPUTE

    @property
    def is_send(self) -> bool:
        """True for SEND_F and SEND_B."""
        return self._value_ in _SEND

    @property
    def is_recv(self) -> bool:
        """True for RECV_F and RECV_B."""
        return self._value_ in _RECV

    @property
    def is_segment(self) -> bool:
        """True for the actions on a (stage, microbatch): compute and messages between segments."""
        return self._value_ in _SEGMENT

    @property
    def names_bucket(self) -> bool:
        """True for REDUCE, GATHER and FREE."""
        return self._value_ in _BUCKET


_COMPUTE = frozenset({"F", "B", "W"})
_SEND = frozenset({"SEND_F", "SEND_B"})
_RECV = frozenset({"RECV_F", "RECV_B"})
_SEGMENT = _COMPUTE | _SEND | _RECV
_BUCKET = frozenset({"REDUCE", "GATHER", "FREE"})


_SEGMENT_PATTERN = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|W)(\d+)(?:(->|<-)(\d+))?")
_BUCKET_PATTERN = re.compile(r"(REDUCE|GATHER|FREE) b(\d+)")
_KINDS_BY_TEXT = {kind.value: kind for kind in ActionKind}


@dataclass(frozen=True, order=True)
class Action:
    """One step of a rank's program.

    Attributes:
        stage: the pipeline stage (segment) of a compute or message action; for a message, the local stage.
            None for the step's other actions.
        microbatch: the microbatch of a compute or message action; None for the others.
        kind: see ``ActionKind``.
        peer: the other rank of a SEND/RECV; None for every other kind.
        bucket: the rank's gradient bucket a REDUCE, GATHER or FREE acts on; None for every other kind.
    """

    stage: int | None
    microbatch: int | None
    kind: ActionKind
    peer: int | None = None
    bucket: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ActionKind(self.kind))
        kind = self.kind
        if kind.is_segment:
            if self.stage is None or self.microbatch is None or self.stage < 0 or self.microbatch < 0:
                raise ValueError(f"Action {self.stage}/{kind.value}/{self.microbatch}: stage and microbatch must be >= 0")
        elif self.stage is not None or self.microbatch is not None:
            raise ValueError(f"Action {kind.value} names no stage or microbatch (got {self.stage}, {self.microbatch})")
        if kind.is_compute == (self.peer is not None) and kind.is_segment:
            needs = "takes no" if kind.is_compute else "needs a"
            raise ValueError(f"Action kind {kind.value} {needs} peer rank (got {self.peer})")
        if not kind.is_segment and self.peer is not None:
            raise ValueError(f"Action kind {kind.value} takes no peer rank (got {self.peer})")
        if self.peer is not None and self.peer < 0:
            raise ValueError(f"Action peer rank must be >= 0, got {self.peer}")
        if kind.names_bucket != (self.bucket is not None) or (self.bucket is not None and self.bucket < 0):
            raise ValueError(f"Action kind {kind.value} {'needs a bucket index >= 0' if kind.names_bucket else 'takes no bucket'} (got {self.bucket})")

    @classmethod
    def step(cls, kind: ActionKind | str, bucket: int | None = None) -> Action:
        """An action of the step that names no stage: ``LOSS``, ``STEP``, or ``REDUCE``/``GATHER``/``FREE`` of a bucket."""
        return cls(None, None, ActionKind(kind), None, bucket)

    def __str__(self) -> str:
        if self.kind.names_bucket:
            return f"{self.kind.value} b{self.bucket}"
        if not self.kind.is_segment:
            return self.kind.value
        text = f"{self.stage}{self.kind.value}{self.microbatch}"
        if self.kind.is_send:
            return f"{text}->{self.peer}"
        if self.kind.is_recv:
            return f"{text}<-{self.peer}"
        return text

    @classmethod
    def parse(cls, text: str) -> Action:
        """Read the compact form back: ``Action.parse(str(action)) == action``.

        Raises:
            ValueError: when ``text`` is none of ``"<stage><kind><microbatch>"`` (with ``->peer`` after a SEND and
                ``<-peer`` after a RECV), ``"REDUCE b<k>"``, ``"GATHER b<k>"``, ``"FREE b<k>"``, ``"LOSS"``, ``"STEP"``.
        """
        text = text.strip()
        if text in (ActionKind.LOSS.value, ActionKind.STEP.value):
            return cls.step(text)
        bucket = _BUCKET_PATTERN.fullmatch(text)
        if bucket is not None:
            return cls.step(bucket.group(1), int(bucket.group(2)))
        match = _SEGMENT_PATTERN.fullmatch(text)
        if match is None:
            raise ValueError(
                f"cannot parse action {text!r}: expected e.g. '1F0', '0SEND_F0->1', '1RECV_F0<-0', 'REDUCE b2', 'GATHER b0', 'LOSS' or 'STEP'"
            )
        stage, kind_text, microbatch, arrow, peer = match.groups()
        kind = _KINDS_BY_TEXT[kind_text]
        expected_arrow = "->" if kind.is_send else "<-" if kind.is_recv else None
        if arrow != expected_arrow:
            raise ValueError(f"cannot parse action {text!r}: {kind_text} needs {expected_arrow or 'no arrow'}, got {arrow or 'none'}")
        return cls(int(stage), int(microbatch), kind, None if peer is None else int(peer))
