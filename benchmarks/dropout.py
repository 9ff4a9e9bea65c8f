"""Cost of plan-invariant dropout (counter-based hash masks) against torch's dropout, same tensor sizes.

Columns, as ratios to ``torch.nn.functional.dropout`` (forward):

- unfused: the eager draw (``randomness.eager_random_box``, one torch op per hash step), then
  ``x * (u >= p) * 1 / (1 - p)`` as capture writes it;
- fused draw: the same graph with the uniform drawn by the fused kernel (``random_box``);
- fused dropout: mask and multiply in one kernel (``fused_random.dropout_box``);
- fwd+bwd: the fused dropout's forward and backward (mask regenerated) against torch's.

Then the first-call (compile) seconds of each fused kernel and the number of torch.compile frames
compiled. Run: python benchmarks/dropout.py [--threads N] (``TORCHINDUCTOR_CACHE_DIR`` set to an
empty folder for a cold compile).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Callable

os.environ.setdefault("LIGHTNING_NNSCALER_COMPILE_RANDOM", "1")

import torch  # noqa: E402

from lightning_nnscaler.ir import fused_random  # noqa: E402
from lightning_nnscaler.ir.randomness import eager_random_box, op_key, random_box  # noqa: E402

P = 0.1
SCALE = 1.0 / (1.0 - P)
KEY = op_key("dropout")
SIZES = [(64, 1024), (16, 128, 768), (8, 1024, 768), (4, 12, 512, 512)]


def unfused(x: torch.Tensor) -> torch.Tensor:
    """Dropout as the captured graph ran it before fusing: eager draw, compare, two multiplies."""
    size = list(x.shape)
    return x * (eager_random_box(size, [0] * len(size), size, KEY, "uniform", torch.float32, x.device) >= P) * SCALE


def fused_draw(x: torch.Tensor) -> torch.Tensor:
    """Dropout as the captured graph runs it now: fused draw, then compare and two multiplies."""
    size = list(x.shape)
    return x * (random_box(size, [0] * len(size), size, KEY, "uniform", torch.float32, x.device) >= P) * SCALE


def fused_dropout(x: torch.Tensor) -> torch.Tensor:
    """Mask and multiply in one kernel."""
    return fused_random.dropout_box(x, [0] * x.dim(), list(x.shape), KEY, P)


def torch_dropout(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.dropout(x, P, training=True)


def forward_backward(dropout: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``dropout``'s forward and backward on a fresh leaf (gradient of ones)."""

    def run(x: torch.Tensor) -> torch.Tensor:
        leaf = x.detach().requires_grad_()
        dropout(leaf).backward(torch.ones_like(x))
        return leaf.grad

    return run


def seconds(functions: list[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor, repeats: int = 9) -> list[float]:
    """Each function's best of ``repeats`` timed calls (after one warm-up), the functions taking turns
    (so that a busy spell of the machine does not fall on one function only)."""
    for function in functions:
        function(x)
    best = [float("inf")] * len(functions)
    for _ in range(repeats):
        for number, function in enumerate(functions):
            if x.is_cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            function(x)
            if x.is_cuda:
                torch.cuda.synchronize()
            best[number] = min(best[number], time.perf_counter() - start)
    return best


def first_calls(x: torch.Tensor) -> dict[str, float]:
    """Seconds of the first fused draw, dropout forward and backward (compiling each kernel)."""
    times = {}
    for name, function in (("draw", fused_draw), ("dropout fwd+bwd", forward_backward(fused_dropout))):
        start = time.perf_counter()
        function(x)
        times[name] = time.perf_counter() - start
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    threads = parser.parse_args().threads
    if threads:
        torch.set_num_threads(threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"device {device}, {torch.get_num_threads()} threads, p = {P}, {fused_random.ENVIRONMENT}={fused_random.mode()}")
    compiles = first_calls(torch.randn(SIZES[0], device=device))
    print("first calls (compile), s: " + ", ".join(f"{name} {value:.1f}" for name, value in compiles.items()))
    print(f"{'shape':>22} {'elements':>10} {'torch ms':>9} {'unfused':>8} {'fused draw':>11} {'fused dropout':>14} {'fwd+bwd':>8}")
    for shape in SIZES:
        x = torch.randn(shape, device=device)
        reference, *ours = seconds([torch_dropout, unfused, fused_draw, fused_dropout], x)
        training = seconds([forward_backward(torch_dropout), forward_backward(fused_dropout)], x)
        ratios = [value / reference for value in ours] + [training[1] / training[0]]
        columns = " ".join(f"{ratio:>{width}.2f}" for ratio, width in zip(ratios, (8, 11, 14, 8)))
        print(f"{str(shape):>22} {x.numel():>10} {reference * 1e3:>9.2f} {columns}")
    from torch._dynamo.utils import counters

    print(f"torch.compile frames compiled: {counters['stats']['unique_graphs']}, off: {fused_random._state['off'] or 'none'}")


if __name__ == "__main__":
    main()
