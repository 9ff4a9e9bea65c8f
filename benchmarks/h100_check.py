"""Checks the shipped H100 spec (``sim/specs/h100.yaml``) on a real H100: a few ops and one GPT step,
the simulator's prediction next to the measured time (CUDA events, median of repeats).

Ops: fp32 and bf16 4096³ matrix products (compute bound) and an fp32 add over 2^28 elements
(memory bound), predicted by the roofline. GPT step: GPT-2 124M shapes (seq 1024, batch 8, fp32,
no TF32), forward + backward + AdamW on one GPU, predicted by ``sim.predict`` of its one-rank dp plan.
Run on a machine with an H100: python benchmarks/h100_check.py
"""

from __future__ import annotations

import statistics

import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.sim import load_spec, predict
from lightning_nnscaler.sim.costs import roofline_seconds

REPEATS = 10


def cuda_seconds(fn, repeats: int = REPEATS) -> float:
    """Median seconds of ``fn()`` on the GPU (after two warm-ups)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    spec = load_spec("h100")
    print(f"device: {torch.cuda.get_device_name()}; spec {spec.name}")
    rows = []
    n = 4096
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(n, n, device="cuda", dtype=dtype), torch.randn(n, n, device="cuda", dtype=dtype)
        measured = cuda_seconds(lambda: a @ b)
        predicted = roofline_seconds(spec, 2 * n**3, 3 * n * n * a.element_size(), str(dtype).removeprefix("torch."), matmul=True)
        rows.append((f"matmul {n}^3 {dtype}".replace("torch.", ""), predicted, measured))
    x = torch.randn(2**28, device="cuda")
    y = torch.randn(2**28, device="cuda")
    measured = cuda_seconds(lambda: x + y)
    rows.append(("add 2^28 float32", roofline_seconds(spec, 2**28, 3 * 4 * 2**28, "float32", matmul=False), measured))

    config = GPTConfig(vocab_size=50257, seq_len=1024, hidden=768, layers=12, heads=12)
    torch.manual_seed(0)
    model = GPT(config)
    batch = model.example_batch(8, torch.Generator().manual_seed(1))
    plan = lnn.parallelize(model, batch, "dp", 1, step="training_step")
    predicted = predict(plan, spec).step_seconds
    model = model.cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cuda_batch = tuple(tensor.cuda() for tensor in batch)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model.training_step(cuda_batch, 0).backward()
        optimizer.step()

    rows.append(("GPT-2 124M step fp32 batch 8 (fwd+bwd+AdamW)", predicted, cuda_seconds(step)))
    print(f"{'what':<48} {'predicted ms':>13} {'measured ms':>12} {'pred/meas':>10}")
    for name, predicted, measured in rows:
        print(f"{name:<48} {predicted * 1000:>13.3f} {measured * 1000:>12.3f} {predicted / measured:>10.2f}")


if __name__ == "__main__":
    main()
