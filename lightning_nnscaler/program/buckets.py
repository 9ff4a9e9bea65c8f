"""Gradient buckets: which replicated boxes a rank sums together, in the one order every step sums them.

A box held by several ranks (data-parallel replicas, or replicas a plan made) gets the sum of their
gradients. The boxes of one ``ranks`` tuple are cut into buckets in reverse registration order
(roughly the order backward produces their gradients) at ``bucket_bytes`` (a bucket closes once it
reaches it, as DDP's ``bucket_cap_mb``) and at changes of dtype or of the pipeline stage that reads the boxes. The rank's buckets are then put in
the order their gradients are complete: by the registration position of their earliest box. Every
rank of a tuple holds the same boxes of it, so each bucket is the same on all of its ranks, and any
two ranks order the buckets they share alike: the runtime may start them one after another (or,
under ZeRO, run each bucket's blocking reduce-scatter) without two ranks ever waiting on each other
in different groups.

This is the one place the buckets are cut: the generated code lists them (``BUCKETS``), the runtime's
reducer sums them, and the simulator prices them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

BUCKET_BYTES = 25 * 1024 * 1024
"""DDP's default ``bucket_cap_mb`` (25 MiB): the bucket size when the user gives none."""


@dataclass(frozen=True)
class ReplicatedBox:
    """A parameter box this rank holds with other ranks, in registration order.

    Attributes:
        var: the box's variable in the rank's code.
        ranks: the ranks whose gradients of this box are summed.
        numel: its element count.
        element_bytes: bytes per element.
        dtype: its dtype's name (a bucket holds one dtype).
        stage: see below (a bucket holds one stage's boxes: ZeRO-3 gathers them around that stage's actions).
    """

    var: str
    ranks: tuple[int, ...]
    numel: int
    element_bytes: int
    dtype: str = "float32"
    stage: int | None = None
    """The one pipeline stage whose segments read the box (None: several, or a plan that is not pipelined)."""


@dataclass(frozen=True)
class Bucket:
    """Boxes whose gradients are summed as one flat tensor over ``ranks``.

    Attributes:
        ranks: the ranks summing it.
        vars: its boxes' variables, back to back in its flat buffer (reverse registration order).
        nbytes: its bytes (under ZeRO, with each box padded to a multiple of ``len(ranks)`` elements).
        stage: the one pipeline stage that reads its boxes, or None.
    """

    ranks: tuple[int, ...]
    vars: tuple[str, ...]
    nbytes: int
    stage: int | None = None


def gradient_buckets(boxes: Sequence[ReplicatedBox], bucket_bytes: int = BUCKET_BYTES, *, zero: bool = False) -> tuple[Bucket, ...]:
    """The rank's buckets in the order the step sums them (see the module docstring).

    ``boxes`` are the rank's replicated boxes in registration order; ``zero`` pads each box to a multiple of
    its ranks (ZeRO's equal chunks) when counting a bucket's bytes.

    Raises:
        ValueError: ``bucket_bytes`` is not positive, or a box is listed twice.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    if len({box.var for box in boxes}) != len(boxes):
        raise ValueError("a replicated box is listed twice")
    position = {box.var: index for index, box in enumerate(boxes)}
    cut: list[list[ReplicatedBox]] = []
    open_bucket: dict[tuple[int, ...], tuple[list[ReplicatedBox], int]] = {}
    for box in reversed(boxes):
        members, size = open_bucket.get(box.ranks, (None, 0))
        if members is None or (members[0].dtype, members[0].stage) != (box.dtype, box.stage) or size >= bucket_bytes:
            members, size = [], 0
            cut.append(members)
        members.append(box)
        open_bucket[box.ranks] = (members, size + box.numel * box.element_bytes)
    cut.sort(key=lambda members: -min(position[box.var] for box in members))
    return tuple(
        Bucket(members[0].ranks, tuple(box.var for box in members), sum(_bytes(box, zero) for box in members), members[0].stage) for members in cut
    )


def _bytes(box: ReplicatedBox, zero: bool) -> int:
    if not zero:
        return box.numel * box.element_bytes
    replicas = len(box.ranks)
    return -(-box.numel // replicas) * replicas * box.element_bytes
