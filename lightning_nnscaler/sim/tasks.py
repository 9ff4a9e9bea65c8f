"""What the simulator runs: per rank, an ordered list of tasks (the lowered action list with durations).

A rank's list is the order it runs in, exactly as a rank's program is (DESIGN.md §8). ``Compute``
occupies the rank's compute stream for ``seconds``; ``Send`` posts a message and returns (isend);
``Recv`` blocks until the matching message has arrived — the k-th receive from a peer pairs with
the k-th send to it, as gloo and NCCL pair point-to-point operations in posting order; a
``Collective`` over ``group`` pairs with the same-numbered collective over that group on every
member and starts when the last member reaches it (``blocking=False``: the rank posts it on its
communication stream and goes on; ``WaitCollectives`` blocks until every collective it posted has
ended). ``Compute.activation_bytes`` is what the task adds to (F) or frees from (B) the rank's
live activations, for the memory peak over the schedule; ``Compute.transient_bytes`` the most it holds
above the live bytes it started from while it runs (outputs not yet freed, gradients in flight);
``Compute.gradient_bytes`` the parameter gradients it makes that live to the step's end. A ``Send``'s bytes
count towards its sender's memory from the send until a ``Recv`` releases them or the step ends: the runtime
sends a copy and waits for its sends after backward, or, in a pipeline, once a later message from the peer
proves it taken (``materialize.releases``).

Tasks are named tuples: a 1024-rank step has millions of them, and a tuple is built several times faster
than a frozen dataclass.
"""

from __future__ import annotations

from typing import NamedTuple

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
"""Collective kinds the communication model prices (``costs.CommModel``)."""


class Compute(NamedTuple):
    """Busy the rank's compute stream for ``seconds`` (``kind``: forward, backward, weight, optimizer, other)."""

    seconds: float
    kind: str = "forward"
    label: str = ""
    activation_bytes: int = 0
    transient_bytes: int = 0
    gradient_bytes: int = 0
    held_bytes: int = 0
    """Bytes the rank holds from the end of this task on (negative: stops holding) that are neither activations nor
    parameter gradients: what a split backward's input half keeps for its weight half."""


class Send(NamedTuple):
    """Post ``nbytes`` to ``peer`` (asynchronous); the bytes arrive after the link's latency and transfer time."""

    peer: int
    nbytes: int
    label: str = ""


class Recv(NamedTuple):
    """Wait for the next message from ``peer``; its arrival proves ``peer`` received ``releases`` bytes this rank
    sent it (``materialize.releases``), whose copies the rank then drops."""

    peer: int
    label: str = ""
    releases: int = 0
    posted: bool = False
    """Posted where its message is sent (``materialize.posts``): it never asks for a message already sent."""


class Collective(NamedTuple):
    """A ``kind`` collective over ``group`` (sorted ranks) on a buffer of ``nbytes`` per rank."""

    kind: str
    group: tuple[int, ...]
    nbytes: int
    label: str = ""
    blocking: bool = True


class WaitCollectives(NamedTuple):
    """Block until every non-blocking collective this rank posted has ended."""

    label: str = ""


Task = Compute | Send | Recv | Collective | WaitCollectives
