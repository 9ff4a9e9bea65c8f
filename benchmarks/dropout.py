"""Cost of plan-invariant dropout (counter-based hash masks) against torch's dropout, same tensor sizes.

Ours: a uniform drawn with ``ir.randomness.random_box`` (splitmix64 of each element's index), then
``x * (u >= p) * 1 / (1 - p)``, as capture writes it. Torch: ``torch.nn.functional.dropout``.
Run: python benchmarks/dropout.py
"""

from __future__ import annotations

import time

import torch

from lightning_nnscaler.ir.randomness import op_key, random_box

P = 0.1
SIZES = [(64, 1024), (16, 128, 768), (8, 1024, 768), (4, 12, 512, 512)]


def ours(x: torch.Tensor) -> torch.Tensor:
    """Dropout as the captured graph runs it."""
    size = list(x.shape)
    uniform = random_box(size, [0] * len(size), size, op_key("dropout"), "uniform", torch.float32, x.device)
    return x * (uniform >= P) * (1.0 / (1.0 - P))


def seconds(function, x: torch.Tensor, repeats: int = 5) -> float:
    """Best of ``repeats`` timed calls (after one warm-up)."""
    function(x)
    best = float("inf")
    for _ in range(repeats):
        if x.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        function(x)
        if x.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"device {device}, {torch.get_num_threads()} threads, p = {P}")
    print(f"{'shape':>22} {'elements':>10} {'torch ms':>9} {'ours ms':>9} {'ratio':>6}")
    for shape in SIZES:
        x = torch.randn(shape, device=device)
        reference = seconds(lambda t: torch.nn.functional.dropout(t, P, training=True), x)
        hashed = seconds(ours, x)
        print(f"{str(shape):>22} {x.numel():>10} {reference * 1e3:>9.2f} {hashed * 1e3:>9.2f} {hashed / reference:>6.1f}")


if __name__ == "__main__":
    main()
