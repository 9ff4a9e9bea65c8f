"""One-GPU check of the strategy on CUDA: losses vs ``strategy="auto"``, and step time / peak memory.

Each (strategy, precision) runs in its own process (fresh CUDA caching allocator, no order effect),
on one GPU (``devices=1``): the NCCL process group, the generated code on the CUDA device, and the
precision plugins (bf16-mixed, 16-mixed with a GradScaler) are what this exercises; CI has no GPU.

Run: python benchmarks/cuda_check.py [--model small|gpt2] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

SIZES = {
    "small": {"vocab_size": 512, "seq_len": 128, "hidden": 256, "layers": 4, "heads": 8},
    "gpt2": {"vocab_size": 50257, "seq_len": 1024, "hidden": 768, "layers": 12, "heads": 12},  # GPT-2 124M shapes
}
BATCH = 8
WARMUP = 5


def child(strategy: str, precision: str, model: str, steps: int) -> dict[str, Any]:
    """Fit in this process; per-step losses, median step time after warm-up, peak CUDA memory."""
    import lightning_nnscaler  # noqa: F401 - registers the strategies, before lightning

    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_nnscaler.models.gpt import GPT, GPTConfig

    cuda = torch.cuda.is_available()  # a CPU run only checks the script itself
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    config = GPTConfig(**SIZES[model])
    tokens = torch.randint(0, config.vocab_size, (BATCH * steps, config.seq_len + 1), generator=torch.Generator().manual_seed(1))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH)

    class Record(Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []
            self.seconds: list[float] = []

        def on_train_batch_start(self, *args: Any) -> None:
            synchronize()
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *args: Any) -> None:
            synchronize()
            self.seconds.append(time.perf_counter() - self.start)
            self.losses.append(float(outputs["loss"]))

    class Model(GPT):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.compute_loss(batch)

    torch.manual_seed(0)
    record = Record()
    trainer = L.Trainer(
        strategy=strategy, accelerator="gpu" if cuda else "cpu", devices=1, max_steps=steps, precision=precision, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[record],
        use_distributed_sampler=False,  # one device: the same plain loader (and order) for every strategy
    )
    trainer.fit(Model(config), data)
    return {
        "losses": record.losses, "ms": 1000 * statistics.median(record.seconds[WARMUP:]),
        "peak_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else float("nan"),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SIZES), default="small")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--strategies", default="auto,nnscaler,nnscaler_tp,nnscaler_zero3")
    parser.add_argument("--precisions", default="32-true,bf16-mixed,16-mixed")
    parser.add_argument("--child", nargs=2, metavar=("STRATEGY", "PRECISION"), help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.child:
        print("RESULT " + json.dumps(child(*arguments.child, arguments.model, arguments.steps)))
        return
    results: dict[tuple[str, str], dict[str, Any]] = {}
    for precision in arguments.precisions.split(","):
        for strategy in arguments.strategies.split(","):
            command = [sys.executable, __file__, "--model", arguments.model, "--steps", str(arguments.steps), "--child", strategy, precision]
            completed = subprocess.run(command, capture_output=True, text=True, timeout=900)
            lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
            if completed.returncode or not lines:
                print(f"FAILED {strategy} {precision} (exit {completed.returncode}):\n{completed.stderr[-3000:]}")
                continue
            results[(strategy, precision)] = json.loads(lines[0].removeprefix("RESULT "))
    device = next(iter(results.values()))["device"] if results else "?"
    print(f"\nGPT {SIZES[arguments.model]}, batch {BATCH}, {arguments.steps} steps, devices=1 on {device}")
    print(f"{'precision':<11} {'strategy':<16} {'ms/step':>8} {'ratio':>6} {'peak MiB':>9} {'ratio':>6} {'max rel loss diff vs auto':>26}")
    for (strategy, precision), result in results.items():
        auto = results.get(("auto", precision))
        if auto is None:
            continue
        difference = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(result["losses"], auto["losses"]))
        print(
            f"{precision:<11} {strategy:<16} {result['ms']:8.2f} {result['ms'] / auto['ms']:6.3f} {result['peak_mib']:9.0f} "
            f"{result['peak_mib'] / auto['peak_mib']:6.3f} {difference:26.2e}"
        )


if __name__ == "__main__":
    main()
