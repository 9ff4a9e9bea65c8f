"""Where a rank posts a receive: where its message is sent, when that comes before the receive's own place.

A rank's program receives a message where the value is first needed. On a backend that moves a message
only once its receive is posted (gloo), a receive posted after the message was sent waits for the sender's
communication thread to be scheduled again; one posted before finds the message there. So each inline
receive (not a pipeline's boundary message, which ``runtime.pipeline`` receives) is posted at its send's
place in the graph's order, within the same segment; the receive itself stays where it was. A rank's
receives from one peer are then posted in the order that peer sends them, as NCCL would need.
"""

from __future__ import annotations

from lightning_nnscaler.materialize.program import Program, Recv, Send


def receive_posts(program: Program, rank: int | None = None) -> dict[tuple[int, int, int], float]:
    """``(src, dst, tag) -> position`` at which ``dst`` posts its receive of that inline message: the send's
    position, for each receive whose send comes earlier in the graph's order, in the same segment.

    With ``rank``, only that rank's receives (``dst == rank``), reading only the programs of the peers it
    receives from: what one rank's code needs, without a pass over every rank's actions.
    """
    receivers = program.ranks if rank is None else [program.ranks[rank]]
    receives = [
        (rank_program.rank, action) for rank_program in receivers for action in rank_program.actions
        if isinstance(action, Recv) and not action.boundary
    ]
    peers = {action.src for _, action in receives}
    destinations = None if rank is None else {rank}
    sends = {
        (peer, action.dst, action.tag): action for peer in sorted(peers) for action in program.ranks[peer].actions
        if isinstance(action, Send) and not action.boundary and (destinations is None or action.dst in destinations)
    }
    posts = {}
    for dst, action in receives:
        send = sends.get((action.src, dst, action.tag))
        if send is not None and send.position < action.position and send.segment == action.segment:
            posts[action.src, dst, action.tag] = send.position
    return posts
