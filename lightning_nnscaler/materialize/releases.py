"""When a pipeline rank may drop its copy of a message it sent: as soon as a later message proves the peer took it.

The runtime's ``send`` keeps a copy of the tensor until the send is waited for; a gloo send completes
only once its receive is posted, and waiting for it earlier could block. A message ``m`` that rank
``r`` sent to ``p`` is certainly received once ``r`` receives a message that ``p`` sent *after* its
receive of ``m`` (a receive blocks, so ``p``'s program order is a happens-before order). From every
rank's messages in the order the runtime posts them, ``send_releases`` finds, for each sent message,
the first such answer; the receiver of that answer releases the sent message right after receiving it.
Messages no answer follows (the last gradients of a step) are released when the step waits for its sends.

``boundary_messages`` lists a pipelined program's boundary messages in ``runtime.pipeline``'s order: per
``F(s, m)`` the segment's inputs received, then its outputs sent; per ``B`` the gradients of its outputs
received, then the gradients of its inputs sent (a gradient message: ``gradient=True``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Hashable, NamedTuple

from lightning_nnscaler.materialize.program import Program, Recv, Send

_ACTION = re.compile(r"(\d+)([FBW])(\d+)")


class Posted(NamedTuple):
    """One message operation of a rank: ``send`` or ``recv`` of ``message`` (a key both ends share) with ``peer``."""

    kind: str
    peer: int
    message: Hashable


class Message(NamedTuple):
    """A boundary message of a pipelined program: sender, receiver, forward tag, and whether it is the gradient going back."""

    src: int
    dst: int
    tag: int
    gradient: bool


def send_releases(sequences: Sequence[Sequence[Posted]]) -> list[dict[Hashable, list[Hashable]]]:
    """Per rank: ``{received message: [messages it sent that this receipt proves received]}`` (see the module docstring).

    ``sequences[r]`` is rank ``r``'s message operations in the order it posts them. A message that no later
    answer from its receiver follows is in no list.
    """
    position = {(rank, post.kind, post.message): index for rank, posts in enumerate(sequences) for index, post in enumerate(posts)}
    releases: list[dict[Hashable, list[Hashable]]] = [{} for _ in sequences]
    for rank, posts in enumerate(sequences):
        for post in posts:
            if post.kind != "send":
                continue
            taken = position.get((post.peer, "recv", post.message))
            if taken is None:
                continue
            answer = next((later.message for later in sequences[post.peer][taken + 1:] if later.kind == "send" and later.peer == rank), None)
            if answer is not None:
                releases[rank].setdefault(answer, []).append(post.message)
    return releases


def boundary_messages(program: Program, schedules: Sequence[Sequence[str]]) -> list[list[Posted]]:
    """Each rank's boundary messages (``Message`` keys) in the order ``runtime.pipeline`` posts them under ``schedules``
    (each rank's actions as ``"0F1"`` strings)."""
    sequences = []
    for rank_program, schedule in zip(program.ranks, schedules, strict=True):
        rank = rank_program.rank
        inputs: dict[object, list[Recv]] = {}
        outputs: dict[object, list[Send]] = {}
        for action in rank_program.actions:
            if isinstance(action, Recv) and action.boundary and action.src != rank:
                inputs.setdefault(action.segment, []).append(action)
            elif isinstance(action, Send) and action.boundary and action.dst != rank:
                outputs.setdefault(action.segment, []).append(action)
        posts: list[Posted] = []
        for text in schedule:
            stage, kind, microbatch = _ACTION.fullmatch(text).groups()
            segment = (int(stage), int(microbatch))
            received, sent = inputs.get(segment, []), outputs.get(segment, [])
            if kind == "F":
                posts += [Posted("recv", message.src, Message(message.src, rank, message.tag, False)) for message in received]
                posts += [Posted("send", message.dst, Message(rank, message.dst, message.tag, False)) for message in sent]
            elif kind == "B":
                posts += [Posted("recv", message.dst, Message(message.dst, rank, message.tag, True)) for message in sent if message.gradient]
                posts += [Posted("send", message.src, Message(rank, message.src, message.tag, True)) for message in received if message.gradient]
        sequences.append(posts)
    return sequences


def pipeline_releases(program: Program, schedules: Sequence[Sequence[str]]) -> list[dict[Message, list[Message]]]:
    """Per rank of a pipelined ``program``: which of its sent boundary messages each received one releases."""
    return send_releases(boundary_messages(program, schedules))
