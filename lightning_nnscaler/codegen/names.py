"""Variable names in generated code that shadow nothing.

Program variables are named after graph tensors, which are named after the user's ops and modules
(``zeros``, ``token``, ``list``, ``class``, ...). A variable must not shadow what the generated module
itself uses: a keyword (a syntax error), a builtin (``float``, ``slice``), a name of the module's
header (``torch``, ``zeros``, ``assemble``, ``HELD``, ``PROGRAM``, ...), a parameter of a segment
function (``held``, ``shared``, ``received``, ``communicator``, ``token``), a segment function
(``stage0_microbatch0``) or a recompute function. Such a variable gets a trailing ``_`` (PEP 8's
spelling for a name that clashes), then ``_1``, ``_2``, ... until it is unused; other variables keep
their names, so the code still reads as the model.
"""

from __future__ import annotations

import builtins
import keyword
import re
from dataclasses import replace

from lightning_nnscaler.materialize.program import Action, Assemble, Collective, Compute, Recv, RankProgram, Send, writes

# Module-level names of a generated file (see emit.HEADER, emit_rank and codegen.segments) and the segment functions' parameters.
MODULE_NAMES = frozenset({
    "torch", "comm", "assemble", "checkpoint", "zeros", "aten", "DEVICE", "RANK", "WORLD_SIZE", "HELD",
    "GRADIENT_GROUPS", "GROUPS", "ZERO_STAGE", "PIPELINED", "OUTPUTS", "VALUES", "VALUE_PIECES", "held", "communicator", "token",
    "PROGRAM", "BUCKETS", "SEGMENTS", "BOUNDARY_IN", "BOUNDARY_OUT", "RELEASES", "prologue", "shared", "received",
})
RESERVED = frozenset(keyword.kwlist) | frozenset(keyword.softkwlist) | frozenset(dir(builtins)) | MODULE_NAMES
_RECOMPUTE_FUNCTION = re.compile(r"recompute_\d+|stage\d+_microbatch\d+")


def is_reserved(name: str) -> bool:
    """Whether a variable called ``name`` would shadow a name the generated module uses."""
    return name in RESERVED or name.startswith("__") or _RECOMPUTE_FUNCTION.fullmatch(name) is not None


def safe_names(variables: list[str]) -> dict[str, str]:
    """A non-reserved, distinct name for each of ``variables`` (distinct themselves); unreserved ones keep theirs."""
    taken = {name for name in variables if not is_reserved(name)}
    renamed = {}
    for name in variables:
        if not is_reserved(name):
            renamed[name] = name
            continue
        candidate, index = f"{name.strip('_')}_", 0
        while candidate in taken or is_reserved(candidate):
            index += 1
            candidate = f"{name.strip('_')}_{index}"
        taken.add(candidate)
        renamed[name] = candidate
    return renamed


def with_safe_names(program: RankProgram) -> RankProgram:
    """``program`` with every reserved variable renamed (``safe_names``)."""
    variables = [local.var for local in program.inputs] + [var for action in program.actions for var in writes(action)]
    names = safe_names(list(dict.fromkeys(variables)))
    if all(old == new for old, new in names.items()):
        return program
    return RankProgram(
        program.rank,
        [replace(local, var=names[local.var]) for local in program.inputs],
        [_renamed(action, names) for action in program.actions],
        [replace(output, var=names[output.var]) for output in program.outputs],
    )


def _renamed(action: Action, names: dict[str, str]) -> Action:
    if isinstance(action, Compute):
        return replace(action, input_vars=tuple(names[var] for var in action.input_vars), output_vars=tuple(names[var] for var in action.output_vars))
    if isinstance(action, Send):
        return replace(action, source_var=names[action.source_var])
    if isinstance(action, Recv):
        return replace(action, var=names[action.var])
    if isinstance(action, Assemble):
        return replace(action, var=names[action.var], fragments=tuple(replace(fragment, var=names[fragment.var]) for fragment in action.fragments))
    if isinstance(action, Collective):
        return replace(action, var=names[action.var], source_var=names.get(action.source_var, action.source_var))
    raise TypeError(f"unknown action {action!r}")
