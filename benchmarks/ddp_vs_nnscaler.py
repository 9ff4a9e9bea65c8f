"""Step time: Trainer(strategy="nnscaler") with the dp recipe vs Lightning's "ddp" (2 gloo ranks, CPU).

Same model, the same script and DataLoader (``batch_size`` per data-parallel replica, as ddp
expects), so the same global batches; the two strategies alternate (interleaved rounds) so machine
load hits both alike; the figure is the median batch time after warm-up. Goal: ratio <= 0.95.
Run: python benchmarks/ddp_vs_nnscaler.py [--rounds 2 --steps 25]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import lightning_nnscaler as lnn  # noqa: F401 - before lightning (torchvision fix, strategy registration)
import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Dataset

from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.launch import launch

CONFIG = GPTConfig(vocab_size=512, seq_len=128, hidden=256, layers=4, heads=8)
GLOBAL_BATCH = 8
WARMUP = 5


class Tokens(Dataset):
    """Fixed random token sequences (inputs and next-token targets)."""

    def __init__(self, samples: int) -> None:
        generator = torch.Generator().manual_seed(1)
        self.tokens = torch.randint(0, CONFIG.vocab_size, (samples, CONFIG.seq_len + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[index, :-1], self.tokens[index, 1:]


class BatchTimer(Callback):
    """Wall time of every training batch (forward, backward, gradient sync, optimizer step)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.seconds.append(time.perf_counter() - self.start)


def fit(strategy: str, world_size: int, steps: int) -> list[float]:
    """Batch times of one fit."""
    data = DataLoader(Tokens(GLOBAL_BATCH * steps), batch_size=GLOBAL_BATCH // world_size, drop_last=True)  # per replica
    timer = BatchTimer()
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=world_size, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[timer],
    )
    torch.manual_seed(0)
    trainer.fit(GPT(CONFIG), data)
    return timer.seconds


def worker(rank: int, world_size: int, rounds: int, steps: int) -> dict[str, list[float]]:
    """Alternate ddp and nnscaler fits in one process group (as torchrun would start them)."""
    torch.set_num_threads(1)
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    times: dict[str, list[float]] = {"ddp": [], "nnscaler": []}
    for _ in range(rounds):
        for strategy in ("ddp", "nnscaler"):
            times[strategy] += fit(strategy, world_size, steps)[WARMUP:]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=25)
    arguments = parser.parse_args()
    results = launch(worker, 2, arguments.rounds, arguments.steps, timeout=1800)
    ddp = statistics.median(results[0]["ddp"]) * 1000
    ours = statistics.median(results[0]["nnscaler"]) * 1000
    count = len(results[0]["ddp"])
    print(f"GPT hidden {CONFIG.hidden}, {CONFIG.layers} layers, seq {CONFIG.seq_len}, global batch {GLOBAL_BATCH}; 2 gloo ranks, 1 thread each")
    print(f"median batch time over {count} batches per strategy (after {WARMUP} warm-up batches per fit)")
    print(f"{'strategy':<22} {'ms/batch':>9}")
    print(f"{'ddp':<22} {ddp:9.1f}")
    print(f"{'nnscaler (dp)':<22} {ours:9.1f}")
    print(f"ratio nnscaler/ddp: {ours / ddp:.3f} (goal <= 0.95)")


if __name__ == "__main__":
    main()
