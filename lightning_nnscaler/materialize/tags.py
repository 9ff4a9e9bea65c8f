"""Message tags numbered per channel: the ``n``-th message from ``src`` to ``dst`` gets a tag from ``n`` and the pair alone.

A tag must tell apart the messages of one ordered pair of ranks (gloo matches a receive to a send by
source and tag). Numbering every message of the world from one counter would make a rank's tags depend on
the messages of every other pair, so two data-parallel replicas' programs, otherwise the same up to
renaming ranks, would differ in their tags. Per channel, a tag depends only on the messages between the two
ranks, in the order materialization creates them (deterministic from the plan).

The runtime also keys a segment's boundary messages by tag alone (``received[tag]``, ``sent[tag]``), so a
rank's tags towards different peers must differ too: the tag is ``sequence * world_size + offset``, where
``offset = (dst - src) mod world_size`` tells the peers apart and stays the same when both ranks move
by one replica. Tags stay below ``TAG_LIMIT``, where the runtime starts the tags of gradients sent back.
"""

from __future__ import annotations
from lightning_nnscaler.ir.errors import NnScalerError

TAG_LIMIT = 1 << 20
"""Forward tags stay below this (``runtime.autograd_comm.BACKWARD_TAG_OFFSET``: a gradient goes back with tag + it)."""


class TagLimitError(NnScalerError, ValueError):
    """A channel carries more messages than its tags can number below ``TAG_LIMIT``."""


class ChannelTags:
    """Hands out each channel's tags in order (see the module docstring)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._sent: dict[tuple[int, int], int] = {}  # (src, dst) -> messages numbered so far

    def next(self, src: int, dst: int) -> int:
        """The tag of the next message from ``src`` to ``dst``."""
        sequence = self._sent.get((src, dst), 0) + 1
        self._sent[(src, dst)] = sequence
        tag = sequence * self.world_size + (dst - src) % self.world_size
        if tag >= TAG_LIMIT:
            raise TagLimitError(
                f"rank {src} sends rank {dst} {sequence} messages: on {self.world_size} ranks a channel's tags number at most "
                f"{TAG_LIMIT // self.world_size - 1} messages below {TAG_LIMIT}; cut fewer pieces between these two ranks"
            )
        return tag
