"""Code generation of a rank's segments: one function per segment, run in the order of ``PROGRAM``.

A plan that is not pipelined has one segment (``ir.op.WHOLE_STEP``) and no prologue.

A rank's module holds ``prologue`` (the step's ops that need no gradient, run once before any
segment; left out when there are none) and one function per segment ``(stage, microbatch)`` it runs, named
``stage{s}_microbatch{m}``. A segment function reads the held pieces (``held``), what the prologue
computed (``shared``) and the boundary tensors other segments sent it (``received``, by message
tag); it returns the boundary tensors it sends (by tag), its graph outputs and the token of its
own communication chain. Communication *inside* a segment (tensor-parallel peers of the same
stage) stays inline; communication *between* segments is the runtime's (``runtime.pipeline``, at the
program's ``RECV_F``/``SEND_F``/``RECV_B``/``SEND_B`` actions): ``BOUNDARY_IN`` and ``BOUNDARY_OUT`` list
each segment's messages, in the order they are posted to each peer;
``RELEASES`` (pipelined programs) which sent messages the receipt of a message proves taken
(``materialize.releases``), so the runtime drops their copies then instead of at the step's end.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

from lightning_nnscaler.ir.op import PROLOGUE, WHOLE_STEP
from lightning_nnscaler.materialize.program import LocalTensor, RankProgram, Recv, Segment, Send, reads, writes
from lightning_nnscaler.materialize.releases import Message


def segment_function_name(segment: Segment) -> str:
    """``stage{s}_microbatch{m}`` (``prologue`` for the prologue)."""
    if segment == PROLOGUE:
        return "prologue"
    stage, microbatch = segment
    return f"stage{stage}_microbatch{microbatch}"


def segment_of(item: Any) -> Segment:
    """The segment of an action or rank output: its own, or ``WHOLE_STEP`` in a plan that is not pipelined."""
    return WHOLE_STEP if item.segment is None else item.segment


def segments_of(program: RankProgram) -> dict[Segment, RankProgram]:
    """The rank's actions grouped by segment (each group in program order) with that segment's outputs."""
    grouped: dict[Segment, RankProgram] = defaultdict(lambda: RankProgram(program.rank, program.inputs))
    grouped[PROLOGUE]  # every rank has a prologue, maybe empty
    for action in program.actions:
        grouped[segment_of(action)].actions.append(action)
    for output in program.outputs:
        grouped[segment_of(output)].outputs.append(output)
    return dict(grouped)


def emit_segments(
    rank_program: RankProgram, body: Callable[[RankProgram, set[str]], list[str]], releases: dict[Message, list[Message]] | None = None,
) -> list[str]:
    """The segment part of a rank's module: the boundary tables, the prologue and the segment functions.

    ``releases`` (pipelined programs, ``materialize.releases.pipeline_releases``): the rank's ``RELEASES`` table.

    ``body(segment_program, returned)`` gives the statement lines of one segment (``emit._body``; ``returned``:
    the variables the function's ``return`` reads, which its statements must keep). Empty
    tables print on one line and an empty prologue is left out (the runtime skips a missing one).
    """
    segments = segments_of(rank_program)
    held = {local.var: local for local in rank_program.inputs}
    prologue_vars = {var for action in segments[PROLOGUE].actions for var in writes(action)}
    lines: list[str] = []
    received = {
        segment: [action for action in part.actions if isinstance(action, Recv) and action.boundary] for segment, part in segments.items()
    }
    sent = {segment: [action for action in part.actions if isinstance(action, Send) and action.boundary] for segment, part in segments.items()}
    lines += _table(
        "BOUNDARY_IN", "segment: messages received before its forward, in order (tag, from rank, shape, dtype, gradient goes back)",
        {segment: ", ".join(f"({action.tag}, {action.src}, {action.shape!r}, torch.{action.dtype}, {action.gradient})" for action in actions)
         for segment, actions in received.items() if actions},
    )
    lines += _table(
        "BOUNDARY_OUT", "segment: messages sent after its forward, in order (tag, to rank, gradient comes back)",
        {segment: ", ".join(f"({action.tag}, {action.dst}, {action.gradient})" for action in actions) for segment, actions in sent.items() if actions},
    )
    if releases is not None:
        lines += _releases_table(rank_program.rank, releases)
    needed_from_prologue = sorted({
        var for segment, part in segments.items() if segment != PROLOGUE for action in part.actions for var in reads(action)
        if var in prologue_vars
    } | {output.var for output in segments[PROLOGUE].outputs})
    if segments[PROLOGUE].actions or segments[PROLOGUE].outputs:
        lines += ["", ""] + _prologue(segments[PROLOGUE], set(held), needed_from_prologue, body)
    for segment, part in segments.items():
        if segment != PROLOGUE:
            lines += ["", ""] + _segment_function(segment, part, held, prologue_vars, body)
    lines += ["", ""]
    listed = ", ".join(f"{segment!r}: {segment_function_name(segment)}" for segment in segments if segment != PROLOGUE)
    lines.append(f"SEGMENTS = {{{listed}}}")
    return lines


def _releases_table(rank: int, releases: dict[Message, list[Message]]) -> list[str]:
    comment = "message received (from rank, tag, is a gradient): the messages sent (to rank, tag, is a gradient) it proves taken"
    if not releases:
        return [f"RELEASES = {{}}  # {comment}"]
    lines = [f"RELEASES = {{  # {comment}"]
    for received, sent in releases.items():
        entries = ", ".join(repr((message.dst, message.tag, message.gradient)) for message in sent)
        lines.append(f"    {(received.src, received.tag, received.gradient)!r}: [{entries}],")
    return [*lines, "}"]


def _table(name: str, comment: str, rows: dict[Segment, str]) -> list[str]:
    if not rows:
        return [f"{name} = {{}}  # {comment}"]
    return [f"{name} = {{  # {comment}", *(f"    {segment!r}: [{entries}]," for segment, entries in rows.items()), "}"]


def _prologue(part: RankProgram, held: set[str], results: list[str], body) -> list[str]:
    lines = ["def prologue(held, communicator, token):"]
    lines.append('    """The step\'s ops that need no gradient (batch metadata, masks), run once before any segment."""')
    lines += [f"    {var} = held[{var!r}]" for var in _outside_reads(part, held)]
    lines += ["    " + line for line in body(part, set(results))]
    lines.append(f"    return {{{', '.join(f'{var!r}: {var}' for var in results)}}}, token")
    return lines


def _segment_function(segment: Segment, part: RankProgram, held: dict[str, LocalTensor], prologue_vars: set[str], body) -> list[str]:
    stage, microbatch = segment
    lines = [f"def {segment_function_name(segment)}(held, shared, received, communicator, token):"]
    lines.append(f'    """Stage {stage}, microbatch {microbatch}: returns (sent by tag, outputs by graph name, token)."""')
    for var in _outside_reads(part, set(held) | prologue_vars):
        if var in held:
            lines.append(f"    {var} = held[{var!r}]  # {tuple(stop - start for start, stop in held[var].box)}")
        else:
            lines.append(f"    {var} = shared[{var!r}]")
    sent = [action for action in part.actions if isinstance(action, Send) and action.boundary]
    lines += ["    " + line for line in body(part, {action.source_var for action in sent} | {output.var for output in part.outputs})]
    sent_text = ", ".join(f"{action.tag}: {action.source_var}{_slices(action.region)}" for action in sent)
    outputs = ", ".join(f"{output.name!r}: {output.var}" for output in part.outputs)
    lines.append(f"    return {{{sent_text}}}, {{{outputs}}}, token")
    return lines


def _outside_reads(part: RankProgram, available: set[str]) -> list[str]:
    """Variables the segment reads but does not define, that ``available`` holds, in first-read order."""
    defined: set[str] = set()
    outside: list[str] = []
    for action in part.actions:
        for var in reads(action):
            if var not in defined and var in available and var not in outside:
                outside.append(var)
        defined.update(writes(action))
    for output in part.outputs:
        if output.var not in defined and output.var in available and output.var not in outside:
            outside.append(output.var)
    return outside


def boundary_lines(action: Send | Recv) -> list[str]:
    """A boundary message inside a segment's body: a receive reads ``received``; a send is returned."""
    if isinstance(action, Recv):
        return [f"{action.var} = received[{action.tag}]  # from rank {action.src}"]
    return []


def _slices(region: tuple[slice, ...]) -> str:
    if not region:
        return ""
    return "[" + ", ".join(f"{part.start}:{part.stop}" for part in region) + "]"


def is_boundary(action: object) -> bool:
    """Whether ``action`` is a message between segments (handled by the runtime, not inline)."""
    return isinstance(action, (Send, Recv)) and action.boundary

