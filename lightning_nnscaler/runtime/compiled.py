"""Each segment function of a rank's generated module run under ``torch.compile`` (opt-in: ``compile=True``).

A segment (stage, microbatch) already lies between communications: its boundary messages are the
pipeline runner's (``runtime.pipeline``), outside the function. What communication stays inside one
(tensor-parallel collectives, point-to-point pieces, a posted receive) becomes an explicit graph break:
the segment's functions see ``comm`` (``runtime.autograd_comm``) and the communicator through wrappers
that ``torch.compiler.disable`` marks, so Dynamo compiles the compute between two communications as one
graph (forward, and its backward through AOTAutograd) and runs each communication eagerly, its
autograd node and token chain unchanged: backward still replays a rank's communication in reverse.

The generated module itself is not changed (its source stays what ``Plan.save_code`` writes): its
functions are rebound to a copy of its globals in which ``comm`` is the untraced wrapper, so helpers the
segments call (recompute blocks) see it too. The prologue (run once per step, without gradients) stays
eager.

Zero-bubble (``W`` actions): the input/weight split of backward (``runtime.split_backward``) walks the
autograd graph, in which each compiled graph is one node whose backward would compute every gradient
of that graph at once. So for a module with W actions each graph's backward is compiled in two halves
(``runtime.compiled_split``): an input half (only the nodes the gradients of the graph's activations
need) and a weight half (the remaining nodes, for the parameters' gradients, reading the saved tensors
and the intermediates the input half hands over). B runs the input half alone and W the weight half
alone, so that B and W together run each backward op once, both compiled. This holds for a graph that
is alone in its group of parameters (a pure pipeline segment is one graph: zb1 or zbv on a GPT without
tensor parallelism). Graphs that share parameters across a graph break (inline communication between
two uses of a weight), backends other than ``inductor`` and ``aot_eager``, and a user's compile context
(``CompileOptions.compiler``) keep the backward whole: it runs in both halves, B and W each costing
about a whole backward of it. The input half runs with the graph retained (its W comes later), and a
whole backward may run twice, so segments are compiled without AOTAutograd's donated buffers
(``torch._functorch.config.donated_buffer``: inductor's backward would reuse saved tensors' memory),
every plan's alike, since the compile caches can hand one plan's graph to another.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from lightning_nnscaler.program import ActionKind
from lightning_nnscaler.runtime import autograd_comm
from lightning_nnscaler.runtime.compiled_split import SplitBackend, split_backend
from lightning_nnscaler.runtime.pipeline import module_actions

SegmentFunction = Callable[..., Any]


@dataclass(frozen=True)
class CompileOptions:
    """How segments are compiled: ``torch.compile(segment, **options)``, or ``compiler(segment)`` when given.

    ``compiler`` is the ``torch.compile`` context of a module the user compiled (``OptimizedModule.dynamo_ctx``,
    which Lightning keeps), so the segments run under that call's backend, mode and options.
    """

    options: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments of ``torch.compile``: backend, mode, fullgraph, dynamic, options."""
    compiler: Callable[[SegmentFunction], SegmentFunction] | None = None
    """A function that compiles a function (a ``torch.compile`` context); it wins over ``options``."""

    def __post_init__(self) -> None:
        """Refuse an option ``torch.compile`` does not take, naming the ones it does."""
        accepted = set(inspect.signature(torch.compile).parameters) - {"model"}
        unknown = sorted(set(self.options) - accepted)
        if unknown:
            raise ValueError(f"compile_options {unknown}: not options of torch.compile (it takes {', '.join(sorted(accepted))})")

    def compile(self, function: SegmentFunction, split: list[SplitBackend] | None = None) -> SegmentFunction:
        """``function`` compiled (lazily: Dynamo traces it at its first call).

        With ``split`` (a module with W actions), its graphs' backwards are compiled as input and weight halves
        (``runtime.compiled_split``) where the backend allows (``inductor``, ``aot_eager``; not a ``compiler``), and
        the backend that does so is appended to ``split``."""
        if self.compiler is not None:
            return self.compiler(function)
        splitting = split_backend(self.options) if split is not None else None
        if splitting is None:
            return torch.compile(function, **dict(self.options))
        backend, options = splitting
        split.append(backend)
        return torch.compile(function, backend=backend, **options)


class _UntracedCommunicator:
    """The rank's communicator as a compiled segment sees it: ``post_recv`` (the one method generated code calls
    directly) is a graph break; everything else is the communicator's own (read by the untraced ``comm`` calls)."""

    def __init__(self, communicator: Any) -> None:
        self._communicator = communicator
        self.post_recv = torch.compiler.disable(communicator.post_recv)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._communicator, name)


@functools.cache
def untraced_comm() -> types.SimpleNamespace:
    """``runtime.autograd_comm`` with each public function a ``torch.compiler.disable`` graph break (made once)."""
    functions = {
        name: torch.compiler.disable(value) if inspect.isfunction(value) and value.__module__ == autograd_comm.__name__ else value
        for name, value in vars(autograd_comm).items() if not name.startswith("_")
    }
    return types.SimpleNamespace(**functions)


def _rebound(module: ModuleType) -> dict[str, Any]:
    """A copy of ``module``'s globals where ``comm`` is untraced and every function the module defines sees that copy."""
    rebound = dict(vars(module))
    for name, value in vars(module).items():
        if value is autograd_comm:
            rebound[name] = untraced_comm()
    for name, value in vars(module).items():
        if isinstance(value, types.FunctionType) and value.__module__ == module.__name__:
            copy = types.FunctionType(value.__code__, rebound, value.__name__, value.__defaults__, value.__closure__)
            copy.__kwdefaults__, copy.__doc__, copy.__qualname__ = value.__kwdefaults__, value.__doc__, value.__qualname__
            rebound[name] = copy
    return rebound


@contextlib.contextmanager
def compile_settings(module: ModuleType) -> Iterator[None]:
    """The settings a step of compiled segments runs under (forward, and backward, whose graphs AOTAutograd compiles at
    the first backward): no donated buffers, so that a graph's backward may run with its graph retained or twice
    (zero-bubble's B and W) and find its saved tensors intact, every plan's alike (the compile caches may hand one
    plan's graph to another); and for a module with W actions, no compiled graph read from the caches at all (one
    compiled elsewhere with donated buffers, or with its backward not split, could be found there). Torch's config settings are per thread (context variables): ranks run as threads
    (``run_ranks``) each set their own."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with contextlib.ExitStack() as settings:
        settings.enter_context(functorch_config.patch(donated_buffer=False))
        if any(action.kind is ActionKind.WEIGHT for action in module_actions(module)):
            settings.enter_context(functorch_config.patch(enable_autograd_cache=False))
            settings.enter_context(inductor_config.patch(fx_graph_cache=False))
        yield


ZERO_BUBBLE_COMPILE_TORCH = (2, 13)
"""The first torch whose autograd runs a backward from a compiled graph's node (``GradientEdge``), which W needs: torch
2.11 refuses to read such a node's input metadata (seen on a lent GPU machine); 2.12 was not tried."""


def require_split_support() -> None:
    """Refuse compiled zero-bubble segments (W actions) on a torch that cannot run W from a compiled graph, before any step."""
    version = torch.torch_version.TorchVersion(torch.__version__)
    if version < ZERO_BUBBLE_COMPILE_TORCH:
        raise RuntimeError(
            f"compile=True with a zero-bubble schedule (zb1, zbv, vhalf, dualpipev: W actions) needs torch >= "
            f"{'.'.join(map(str, ZERO_BUBBLE_COMPILE_TORCH))} (this is {torch.__version__}, whose autograd cannot start W at a "
            "compiled graph): use compile=False, a schedule without W (1f1b, interleaved), or a newer torch")


def compile_segments(module: ModuleType, options: CompileOptions) -> dict[tuple[int, int], SegmentFunction]:
    """The module's ``SEGMENTS``, each compiled (``options.compile``), called with the same arguments.

    Compilation happens at a segment's first call (Dynamo's), per rank; the module's own functions are untouched.
    Run them under ``compile_settings(module)``.
    """
    rebound = _rebound(module)
    wrapped: dict[int, _UntracedCommunicator] = {}
    split = [] if any(action.kind is ActionKind.WEIGHT for action in module_actions(module)) else None
    if split is not None:
        require_split_support()

    def compiled(function: SegmentFunction) -> SegmentFunction:
        traced = options.compile(rebound[function.__name__], split)

        @functools.wraps(function)
        def run(held: dict[str, torch.Tensor], shared: dict[str, torch.Tensor], received: dict[int, torch.Tensor], communicator: Any,
                token: torch.Tensor) -> Any:
            # One wrapper per communicator, so that Dynamo's guards on it hold from call to call.
            untraced = wrapped.get(id(communicator))
            if untraced is None or untraced._communicator is not communicator:
                untraced = wrapped[id(communicator)] = _UntracedCommunicator(communicator)
            return traced(held, shared, received, untraced, token)

        run.split_backends = split  # type: ignore[attr-defined]  # the backends that split its backwards (tests read them)
        return run

    return {segment: compiled(function) for segment, function in module.SEGMENTS.items()}
