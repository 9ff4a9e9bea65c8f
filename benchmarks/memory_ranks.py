"""One configuration of ``benchmarks/memory.py --only rss``: a short fit whose every rank reports its peak memory.

Run by ``memory.py`` in a fresh process per configuration (Lightning launches the other ranks, as users run it):
``python benchmarks/memory_ranks.py --strategy nnscaler_tp --devices 4 --out DIR``. Each rank writes
``DIR/rank<r>.json``: its peak resident memory above what the process held before the model existed (CPU: RSS
high-water mark; CUDA: ``max_memory_allocated``), and on an nnscaler run explain()'s and the simulator's per-rank
predictions.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
from pathlib import Path

import torch

import lightning as L  # noqa: E402
import lightning_nnscaler as lnn  # noqa: F401,E402 - registers the strategies
from lightning_nnscaler.explain import MEMORY_KEYS  # noqa: E402
from lightning_nnscaler.models.gpt import GPT, GPTConfig  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

CONFIG = GPTConfig(vocab_size=8192, seq_len=128, hidden=1024, layers=10, heads=16)
"""134M parameters: fp32 AdamW training state (parameters, gradients, two moments) of 2.0 GiB on one device."""
GLOBAL_BATCH = 4
STEPS = 3


def resident_bytes() -> int:
    """This process's resident memory now."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_bytes() -> int:
    """This process's resident memory high-water mark."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def make_strategy(strategy: str, params: dict[str, int]) -> str | lnn.NnScalerStrategy:
    """The Trainer's ``strategy``: the name, or an NnScalerStrategy of that recipe with ``params``."""
    if not params:
        return strategy
    return lnn.NnScalerStrategy(recipe=strategy.removeprefix("nnscaler_"), **params)


def replicas(strategy: str, devices: int, params: dict[str, int]) -> int:
    """Data-parallel replicas of ``strategy`` on ``devices`` (its DataLoader batch is the global batch over them)."""
    if not strategy.startswith("nnscaler"):
        return devices if strategy == "ddp" else 1
    from lightning_nnscaler.plans.catalog import load_recipe

    recipe = strategy.removeprefix("nnscaler_") if strategy != "nnscaler" else "dp"
    return load_recipe(recipe).layout(devices, params).data_parallel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--params", default="", help="recipe parameters, e.g. dp=1,tp=2,pp=2")
    arguments = parser.parse_args()
    params = {key: int(value) for key, value in (item.split("=") for item in arguments.params.split(",") if item)}
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // arguments.devices))
    bare = resident_bytes()
    L.seed_everything(0, verbose=False)
    tokens = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH * STEPS, CONFIG.seq_len + 1))
    data = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    loader = DataLoader(data, batch_size=GLOBAL_BATCH // replicas(arguments.strategy, arguments.devices, params))
    trainer = L.Trainer(
        strategy=make_strategy(arguments.strategy, params), accelerator="cpu", devices=arguments.devices, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    with trainer.init_module():  # on meta under nnscaler (each rank materializes its pieces), real under ddp / auto
        model = GPT(CONFIG)
    trainer.fit(model, loader)
    report = {"rank": trainer.global_rank, "peak_above_bare": peak_bytes() - bare, "parameters": sum(p.numel() for p in model.parameters())}
    plan = getattr(trainer.strategy, "plan", None)
    if plan is not None:
        report["explain"] = [sum(row[key] for key in MEMORY_KEYS) for row in plan.memory_rows()]
        report["simulated"] = [sum(row[key] for key in MEMORY_KEYS) for row in lnn.sim.predict(plan, "cpu").memory]
    Path(arguments.out).mkdir(parents=True, exist_ok=True)
    (Path(arguments.out) / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
