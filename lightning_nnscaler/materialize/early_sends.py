"""Issuing sends early: a send of data computed from the rank's own inputs alone moves to the start.

A send is asynchronous, so issuing it earlier never makes any rank wait; its receiver, whose
receive stays where it was, then finds the message there instead of waiting for the sender to
reach it. The case that matters is metadata computed from the batch, such as the number of
non-ignored targets of a cross-entropy mean, which every data-parallel rank sends to the others:
computed where the graph computes it (after the whole forward pass), the exchange made every rank
wait for the slowest one mid-step; computed and sent first, the count is waiting when it is needed.

What moves, keeping its order: a send and the compute/assemble actions its data comes from, when
those read only the rank's held inputs (transitively), belong to no recompute group, are not
ordered by ``op_order``, and the sent tensor carries no gradient (an integer or bool dtype), so its
backward has no communication and the backward program is unchanged. Sends to one destination
keep their order (NCCL matches messages by order): only a leading run of them may move.
"""

from __future__ import annotations

import dataclasses

from lightning_nnscaler.materialize.program import Action, Assemble, Compute, RankProgram, Send, reads, writes

START = -1.0  # positions of the moved actions: before the first op of the graph (position 0)


def issue_sends_early(program: RankProgram, ordered_ops: set[str]) -> None:
    """Move the sends of ``program`` that can go first (see the module docstring), in place.

    Args:
        program: One rank's program, its actions in order.
        ordered_ops: Names of the ops an ``op_order`` edge constrains; they never move.
    """
    held = {local.var for local in program.inputs}
    producer = {var: action for action in program.actions for var in writes(action)}
    moved: list[Action] = []
    moved_ids: set[int] = set()
    blocked_destinations: set[int] = set()
    for action in program.actions:
        if not isinstance(action, Send) or action.dst in blocked_destinations:
            continue
        chain = _local_chain(action.source_var, held, producer, ordered_ops)
        if chain is None or _carries_gradient(producer.get(action.source_var), action.source_var):
            blocked_destinations.add(action.dst)
            continue
        for link in [*chain, action]:
            if id(link) not in moved_ids:
                moved_ids.add(id(link))
                moved.append(link)
    if not moved:
        return
    order = {id(action): index for index, action in enumerate(program.actions)}
    moved.sort(key=lambda action: order[id(action)])
    step = 1.0 / (len(moved) + 1)
    early = [dataclasses.replace(action, position=START + index * step) for index, action in enumerate(moved)]
    program.actions = early + [action for action in program.actions if id(action) not in moved_ids]


def _local_chain(var: str, held: set[str], producer: dict[str, Action], ordered_ops: set[str]) -> list[Action] | None:
    """The actions ``var`` is computed by from held inputs alone (producers first), or None if it needs more."""
    chain: list[Action] = []
    pending, seen = [var], set()
    while pending:
        current = pending.pop()
        if current in held or current in seen:
            continue
        seen.add(current)
        action = producer.get(current)
        if not isinstance(action, (Compute, Assemble)):
            return None  # received, or a collective's result
        if isinstance(action, Compute) and (action.op.recompute is not None or action.op.name in ordered_ops):
            return None
        chain.append(action)
        pending.extend(reads(action))
    return chain


def _carries_gradient(action: Action | None, var: str) -> bool:
    """Whether ``var`` (written by ``action``; a held input if None) has a floating-point or complex dtype."""
    if isinstance(action, Compute):
        dtype = action.op.outputs[list(action.output_vars).index(var)].tensor.dtype
    elif isinstance(action, Assemble):
        dtype = action.piece.tensor.dtype
    else:
        return True  # a held input sent as is: keep it where the plan put it
    return dtype.startswith(("float", "bfloat", "complex"))
