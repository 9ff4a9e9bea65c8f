"""Data parallelism: Trainer(strategy="nnscaler") with the dp recipe vs Lightning's "ddp" (2 gloo ranks, CPU).

Every fit runs in processes of its own (a fresh group of 2 ranks, 1 thread each), so neither
strategy inherits the other's allocations; fits alternate ddp, nnscaler, ddp, ... so that machine
load hits both alike. Per fit: the median batch time after warm-up, and per rank the memory the fit
added (peak resident set during the fit minus the resident set before it: gradients, buckets,
optimizer state, activations). Per round, the ratio nnscaler / ddp; the table gives the median
ratio over the rounds and its interquartile range, and says whether the difference is inside the
noise (the IQR straddles 1.0) or not.

One device (``--one-device``): ``strategy="auto"`` vs ``"nnscaler"`` with ``devices=1`` on a GPT of
about 67M parameters with AdamW (its state dominates), each fit in a fresh process: the peak
resident set of the whole process (goal: nnscaler <= 1.03x auto).

Run: python benchmarks/ddp_vs_nnscaler.py [--rounds 7 --steps 30 --models small,large] [--one-device]
"""

from __future__ import annotations

import argparse
import os
import json
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import lightning_nnscaler as lnn  # noqa: F401 - registers the strategies
import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Dataset

from lightning_nnscaler.launch import launch
from lightning_nnscaler.models.gpt import GPT, GPTConfig

MODELS = {
    "small": GPTConfig(vocab_size=512, seq_len=128, hidden=256, layers=4, heads=8),
    "large": GPTConfig(vocab_size=512, seq_len=64, hidden=512, layers=8, heads=8),  # the optimizer step is a larger share
}
STATE_HEAVY = GPTConfig(vocab_size=4096, seq_len=64, hidden=1024, layers=5, heads=8)  # about 67M parameters
GLOBAL_BATCH = 8
WARMUP = 5
WORLD_SIZE = 2


class Tokens(Dataset):
    """Fixed random token sequences (inputs and next-token targets)."""

    def __init__(self, config: GPTConfig, samples: int) -> None:
        generator = torch.Generator().manual_seed(1)
        self.tokens = torch.randint(0, config.vocab_size, (samples, config.seq_len + 1), generator=generator)

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


def resident_mib() -> float:
    """This process's resident set now, in MiB."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def fit(rank: int, world_size: int, strategy: str, model: str, steps: int) -> dict[str, float]:
    """One fit on this rank: median batch time after warm-up (s) and the memory the fit added (MiB)."""
    torch.set_num_threads(1)
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    config = MODELS[model]
    data = DataLoader(Tokens(config, GLOBAL_BATCH * steps), batch_size=GLOBAL_BATCH // world_size, drop_last=True)  # per replica
    timer = BatchTimer()
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=world_size, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[timer],
    )
    torch.manual_seed(0)
    module = GPT(config)
    before = resident_mib()
    trainer.fit(module, data)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"seconds": statistics.median(timer.seconds[WARMUP:]), "added_mib": peak - before}


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile)."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    first, median, third = statistics.quantiles(values, n=4, method="inclusive")
    return first, median, third


def compare(model: str, rounds: int, steps: int) -> None:
    """Alternate ddp and nnscaler fits and print the table for ``model``."""
    results: dict[str, list[list[dict[str, float]]]] = {"ddp": [], "nnscaler": []}
    for _ in range(rounds):
        for strategy in ("ddp", "nnscaler"):
            results[strategy].append(launch(fit, WORLD_SIZE, strategy, model, steps, timeout=1800))
    config = MODELS[model]
    parameters = sum(parameter.numel() for parameter in GPT(config).parameters())
    ratios = [
        statistics.mean(rank["seconds"] for rank in ours) / statistics.mean(rank["seconds"] for rank in theirs)
        for ours, theirs in zip(results["nnscaler"], results["ddp"])
    ]
    print(
        f"\nGPT {model}: hidden {config.hidden}, {config.layers} layers, seq {config.seq_len}, {parameters / 1e6:.1f}M parameters, "
        f"AdamW; global batch {GLOBAL_BATCH}; {WORLD_SIZE} gloo ranks, 1 thread each; {rounds} rounds of {steps} steps"
    )
    print(f"{'strategy':<16} {'ms/batch (median of rounds)':>28} {'MiB added per rank (max)':>26}")
    for strategy in ("ddp", "nnscaler"):
        milliseconds = statistics.median(statistics.mean(rank["seconds"] for rank in fit_) for fit_ in results[strategy]) * 1000
        added = statistics.median(max(rank["added_mib"] for rank in fit_) for fit_ in results[strategy])
        print(f"{strategy:<16} {milliseconds:>28.1f} {added:>26.0f}")
    first, median, third = quartiles(ratios)
    verdict = "inside the noise" if first <= 1.0 <= third else ("faster" if third < 1.0 else "slower")
    print(f"step-time ratio nnscaler/ddp: median {median:.3f}, IQR [{first:.3f}, {third:.3f}] over {len(ratios)} rounds: {verdict} (goal <= 0.95)")
    ours_mem = [max(rank["added_mib"] for rank in fit_) for fit_ in results["nnscaler"]]
    ddp_mem = [max(rank["added_mib"] for rank in fit_) for fit_ in results["ddp"]]
    print(f"memory ratio nnscaler/ddp (median of rounds): {statistics.median(o / d for o, d in zip(ours_mem, ddp_mem)):.3f} (goal <= 1.0)")


def one_device_child(strategy: str, steps: int) -> None:
    """Fit ``STATE_HEAVY`` on one CPU device in this process; print the process's peak resident set (MiB) as JSON."""
    torch.set_num_threads(2)
    data = DataLoader(Tokens(STATE_HEAVY, 2 * steps), batch_size=2, drop_last=True)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
    )
    torch.manual_seed(0)
    trainer.fit(GPT(STATE_HEAVY), data)
    print(json.dumps({"peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def one_device(rounds: int, steps: int) -> None:
    """Peak resident memory of a one-device fit, auto vs nnscaler, each in a fresh process, alternating."""
    peaks: dict[str, list[float]] = {"auto": [], "nnscaler": []}
    for _ in range(rounds):
        for strategy in peaks:
            output = subprocess.run(
                [sys.executable, __file__, "--child", strategy, "--steps", str(steps)], capture_output=True, text=True, check=True
            ).stdout
            peaks[strategy].append(json.loads(output.strip().splitlines()[-1])["peak_mib"])
    parameters = sum(parameter.numel() for parameter in GPT(STATE_HEAVY).parameters())
    print(f"\nOne CPU device: GPT hidden {STATE_HEAVY.hidden}, {STATE_HEAVY.layers} layers, {parameters / 1e6:.0f}M parameters, AdamW, batch 2; {steps} steps")
    print(f"{'strategy':<16} {'peak resident MiB (median of ' + str(rounds) + ')':>34}")
    for strategy, values in peaks.items():
        print(f"{strategy:<16} {statistics.median(values):>34.0f}")
    ratios = [ours / theirs for ours, theirs in zip(peaks["nnscaler"], peaks["auto"])]
    print(f"peak memory ratio nnscaler/auto: median {statistics.median(ratios):.3f}, range [{min(ratios):.3f}, {max(ratios):.3f}] (goal <= 1.03)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--models", default="small,large", help=f"comma-separated, of {sorted(MODELS)}")
    parser.add_argument("--one-device", action="store_true", help="also: peak memory of a one-device fit vs strategy='auto'")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.child:
        return one_device_child(arguments.child, arguments.steps)
    if arguments.one_device:
        one_device(max(3, arguments.rounds // 2), 6)
    for model in filter(None, arguments.models.split(",")):
        compare(model, arguments.rounds, arguments.steps)


if __name__ == "__main__":
    main()
