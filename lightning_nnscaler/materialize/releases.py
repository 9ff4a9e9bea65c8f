"""When a pipeline rank may drop its copy of a message it sent: as soon as a later message proves the peer took it.

The runtime's ``send`` keeps a copy of the tensor until the send is waited for; a gloo send completes
only once its receive is posted, and waiting for it earlier could block. A message ``m`` that rank
``r`` sent to ``p`` is certainly received once ``r`` receives a message that ``p`` sent *after* its
receive of ``m`` (a receive blocks, so ``p``'s program order is a happens-before order). From every
rank's messages in the order the runtime posts them, ``send_releases`` finds, for each sent message,
the first such answer; the receiver of that answer releases the sent message right after receiving it.
Messages no answer follows (the last gradients of a step) are released when the step waits for its sends.

``boundary_messages`` lists a pipelined program's boundary messages in the order the step's ``program.Program``
posts them (``runtime.pipeline`` runs it): per ``RECV_F`` from a peer, the segment's inputs from that peer;
per ``SEND_F`` its outputs to it; per ``RECV_B`` the gradients of its outputs to that peer, per ``SEND_B`` the
gradients of its inputs from it (a gradient message: ``gradient=True``), each in the segment's table order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Hashable, NamedTuple

from lightning_nnscaler.materialize.program import Program, RankProgram, Recv, Send
from lightning_nnscaler.program import Action, ActionKind, Program as StepProgram


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
    return [releases_of(rank, sequences) for rank in range(len(sequences))]


def releases_of(rank: int, sequences: Mapping[int, Sequence[Posted]] | Sequence[Sequence[Posted]]) -> dict[Hashable, list[Hashable]]:
    """Rank ``rank``'s part of ``send_releases``; ``sequences`` needs only ``rank`` and the peers it sends to."""
    releases: dict[Hashable, list[Hashable]] = {}
    received_at: dict[int, dict[Hashable, int]] = {}
    for post in sequences[rank]:
        if post.kind != "send":
            continue
        if post.peer not in received_at:
            received_at[post.peer] = {later.message: index for index, later in enumerate(sequences[post.peer]) if later.kind == "recv"}
        taken = received_at[post.peer].get(post.message)
        if taken is None:
            continue
        answer = next((later.message for later in sequences[post.peer][taken + 1:] if later.kind == "send" and later.peer == rank), None)
        if answer is not None:
            releases.setdefault(answer, []).append(post.message)
    return releases


def boundary_messages(program: Program, steps: StepProgram) -> list[list[Posted]]:
    """Each rank's boundary messages (``Message`` keys) in the order its actions in ``steps`` post them."""
    return [rank_boundary_messages(rank_program, steps.actions[rank_program.rank]) for rank_program in program.ranks]


def rank_boundary_messages(rank_program: RankProgram, actions: Sequence[Action]) -> list[Posted]:
    """One rank's part of ``boundary_messages``."""
    rank = rank_program.rank
    inputs: dict[object, list[Recv]] = {}
    outputs: dict[object, list[Send]] = {}
    for action in rank_program.actions:
        if isinstance(action, Recv) and action.boundary and action.src != rank:
            inputs.setdefault(action.segment, []).append(action)
        elif isinstance(action, Send) and action.boundary and action.dst != rank:
            outputs.setdefault(action.segment, []).append(action)
    posts: list[Posted] = []
    for action in actions:
        segment, peer = (action.stage, action.microbatch), action.peer
        if action.kind is ActionKind.RECV_F:
            posts += [Posted("recv", peer, Message(peer, rank, message.tag, False)) for message in inputs.get(segment, []) if message.src == peer]
        elif action.kind is ActionKind.SEND_F:
            posts += [Posted("send", peer, Message(rank, peer, message.tag, False)) for message in outputs.get(segment, []) if message.dst == peer]
        elif action.kind is ActionKind.RECV_B:
            posts += [Posted("recv", peer, Message(peer, rank, message.tag, True)) for message in outputs.get(segment, [])
                      if message.dst == peer and message.gradient]
        elif action.kind is ActionKind.SEND_B:
            posts += [Posted("send", peer, Message(rank, peer, message.tag, True)) for message in inputs.get(segment, [])
                      if message.src == peer and message.gradient]
    return posts


def pipeline_releases(program: Program, steps: StepProgram) -> list[dict[Message, list[Message]]]:
    """Per rank of a pipelined ``program``: which of its sent boundary messages each received one releases."""
    return send_releases(boundary_messages(program, steps))


def rank_releases(program: Program, steps: StepProgram, rank: int) -> dict[Message, list[Message]]:
    """Rank ``rank``'s part of ``pipeline_releases``, from its own messages and those of the peers it sends to."""
    own = rank_boundary_messages(program.ranks[rank], steps.actions[rank])
    sequences = {rank: own}
    for peer in sorted({post.peer for post in own if post.kind == "send"} - {rank}):
        sequences[peer] = rank_boundary_messages(program.ranks[peer], steps.actions[peer])
    return releases_of(rank, sequences)
