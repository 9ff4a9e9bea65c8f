"""Issue 37, GPU part: GPT step time, tokens/s and MFU of ``auto`` and ``nnscaler``, eager and compiled, on one device.

Rows (each fit in its own process, one after another; ``devices=1``, ``--precision`` bf16-mixed by default):

- ``auto``: ``strategy="auto"``, eager, dropout 0;
- ``auto+compile``: ``strategy="auto"`` with ``torch.compile(model)`` (the LightningModule, as Lightning documents), dropout 0;
- ``nnscaler``: ``strategy="nnscaler"``, eager, dropout 0;
- ``nnscaler+compile``: ``NnScalerStrategy(compile=True)`` (default inductor), dropout 0;
- ``nnscaler+compile/drop``: ``NnScalerStrategy(compile=True)``, ``GPTConfig.dropout=0.1``;
- ``auto+compile/drop`` (reference, only when asked: ``--rows all``): ``auto`` with ``torch.compile(model)``, dropout 0.1.

Per row: median step time over the timed steps (the interval between two ends of a training batch, CUDA synchronized,
so data loading, forward, backward and optimizer step all count), after ``--warmup`` steps that are excluded (the
compile happens in the first); tokens/s = batch * seq_len / median step; MFU = model FLOPs/s / ``--peak-tflops``
(default 989: H200 dense bf16), with the model FLOPs per token

    6 * N + 12 * layers * hidden * seq_len

(PaLM appendix B / nanoGPT: 6 N for the matmuls' forward and backward, N = the parameters that take part in a
matmul: every parameter but the token and position embedding tables, the untied LM head counted; 12 L H T for
attention's scores and values, forward and backward, no causal halving); peak CUDA memory; "setup s" from
``trainer.fit`` to the start of the first batch, "first s" the first step (nnscaler traces and plans there, and
torch.compile compiles there); the final loss (and, at dropout 0, each row's largest relative loss difference from
``auto``'s, step by step).
``graphs``: torch.compile graphs compiled in the process, "+timed" those compiled during the timed steps (should be 0:
a recompile there means a guard fails each step; past dynamo's recompile limit the frame would run eagerly). A
nnscaler compiled row also checks that its executor runs compiled segments (``executor.segments``); else it is
marked EAGER.

Then the ratios of issue 37: nnscaler+compile / auto (goal <= 0.75), nnscaler+compile / auto+compile (goal <= 1.0),
nnscaler+compile/drop / nnscaler+compile (goal <= 1.1), PASS or "not met".

Run on the GPU machine (about 5 minutes on an H200, three compiling processes):
    PYTHONPATH=. python3 benchmarks/compiled_gpu.py --model gpt2 --out /tmp/compiled_gpu
Here on a CPU (checks the script only; MFU is meaningless there):
    PYTHONPATH=. python3 benchmarks/compiled_gpu.py --model small --steps 8 --warmup 3
"""

from __future__ import annotations

import argparse
import json
import os
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
DROPOUT = 0.1
ROWS: dict[str, dict[str, Any]] = {
    "auto": {"strategy": "auto", "compile": False, "dropout": 0.0},
    "auto+compile": {"strategy": "auto", "compile": True, "dropout": 0.0},
    "nnscaler": {"strategy": "nnscaler", "compile": False, "dropout": 0.0},
    "nnscaler+compile": {"strategy": "nnscaler", "compile": True, "dropout": 0.0},
    "nnscaler+compile/drop": {"strategy": "nnscaler", "compile": True, "dropout": DROPOUT},
    "auto+compile/drop": {"strategy": "auto", "compile": True, "dropout": DROPOUT},
}
DEFAULT_ROWS = "auto,auto+compile,nnscaler,nnscaler+compile,nnscaler+compile/drop"
GOALS = [  # (name, numerator row, denominator row, goal)
    ("nnscaler+compile / auto (eager)", "nnscaler+compile", "auto", 0.75),
    ("nnscaler+compile / auto+compile", "nnscaler+compile", "auto+compile", 1.0),
    ("nnscaler+compile dropout 0.1 / dropout 0", "nnscaler+compile/drop", "nnscaler+compile", 1.1),
]


def flops_per_token(config: Any, matmul_parameters: int) -> int:
    """Model FLOPs per token of a training step: 6 N + 12 L H T (see the module docstring)."""
    return 6 * matmul_parameters + 12 * config.layers * config.hidden * config.seq_len


def child(row: str, model_size: str, precision: str, steps: int, warmup: int) -> dict[str, Any]:
    """Fit one row in this process; its timings, memory, loss and compile counters."""
    import lightning_nnscaler  # noqa: F401 - registers the strategies, before lightning

    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback
    from torch._dynamo.utils import counters
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_nnscaler import NnScalerStrategy
    from lightning_nnscaler.models.gpt import GPT, GPTConfig

    spec = ROWS[row]
    cuda = torch.cuda.is_available()
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    torch.set_float32_matmul_precision("high")
    config = GPTConfig(**SIZES[model_size], dropout=spec["dropout"])
    tokens = torch.randint(0, config.vocab_size, (BATCH * steps, config.seq_len + 1), generator=torch.Generator().manual_seed(1))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH)

    def graphs() -> int:
        return int(counters["stats"]["unique_graphs"])

    class Record(Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []
            self.ends: list[float] = []
            self.first_start = float("nan")
            self.graphs_after_warmup = 0

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 0:
                synchronize()
                self.first_start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            synchronize()
            self.ends.append(time.perf_counter())
            self.losses.append(float(outputs["loss"]))
            if len(self.ends) == warmup:
                self.graphs_after_warmup = graphs()

    class Model(GPT):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.compute_loss(batch)

    torch.manual_seed(0)
    model: Any = Model(config)
    matmul_parameters = sum(p.numel() for p in model.parameters()) - model.token_embedding.weight.numel() - model.position_embedding.weight.numel()
    if spec["compile"] and spec["strategy"] == "auto":
        model = torch.compile(model)
    strategy: Any = NnScalerStrategy(compile=True) if spec["compile"] and spec["strategy"] == "nnscaler" else spec["strategy"]
    record = Record()
    trainer = L.Trainer(
        strategy=strategy, accelerator="gpu" if cuda else "cpu", devices=1, max_steps=steps, precision=precision, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[record],
        use_distributed_sampler=False,  # one device: the same plain loader (and order) for every row
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    fit_start = time.perf_counter()
    trainer.fit(model, data)
    if len(record.ends) != steps:
        raise RuntimeError(f"{row}: {len(record.ends)} steps recorded, {steps} asked")
    intervals = [b - a for a, b in zip(record.ends[warmup - 1:], record.ends[warmup:])]
    ms = 1000 * statistics.median(intervals)
    tokens_per_s = BATCH * config.seq_len / (ms / 1000)
    compiled_segments = None
    if spec["strategy"] == "nnscaler":
        executor = trainer.strategy.executor
        compiled_segments = executor is not None and executor.segments is not None
    from lightning_nnscaler.ir import fused_random

    return {
        "row": row, "strategy": spec["strategy"], "compile": spec["compile"], "dropout": spec["dropout"], "precision": precision,
        "ms": ms, "ms_min": 1000 * min(intervals), "ms_max": 1000 * max(intervals), "timed_steps": len(intervals),
        "tokens_per_s": tokens_per_s, "flops_per_token": flops_per_token(config, matmul_parameters),
        "matmul_parameters": matmul_parameters,
        "peak_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else float("nan"),
        "setup_s": record.first_start - fit_start, "first_step_s": record.ends[0] - record.first_start,
        "losses": record.losses, "final_loss": record.losses[-1],
        "graphs": graphs(), "graphs_timed": graphs() - record.graphs_after_warmup,
        "graph_breaks": sum(counters["graph_break"].values()), "compiled_segments": compiled_segments,
        "fused_random_off": {key: str(value) for key, value in fused_random._state["off"].items()},
        "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "lightning": L.__version__,
    }


def run_row(row: str, arguments: argparse.Namespace) -> tuple[dict[str, Any] | None, str]:
    """Run ``row`` in a fresh process; its result (None if it failed) and its output."""
    command = [
        sys.executable, os.path.abspath(__file__), "--model", arguments.model, "--precision", arguments.precision,
        "--steps", str(arguments.steps), "--warmup", str(arguments.warmup), "--child", row,
    ]
    try:
        completed = subprocess.run(command, capture_output=True, text=True, timeout=arguments.timeout)
    except subprocess.TimeoutExpired as error:
        output = f"TIMEOUT after {arguments.timeout} s\n{error.stdout or ''}\n{error.stderr or ''}"
        return None, output if isinstance(output, str) else str(output)
    output = completed.stdout + "\n" + completed.stderr
    lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
    if completed.returncode or not lines:
        return None, output
    return json.loads(lines[-1].removeprefix("RESULT ")), output


def row_line(result: dict[str, Any], peak_tflops: float) -> str:
    """One row of the table."""
    mfu = result["tokens_per_s"] * result["flops_per_token"] / (peak_tflops * 1e12)
    check = ""
    if result["compile"] and result["strategy"] == "nnscaler" and not result["compiled_segments"]:
        check = " EAGER!"
    if result["graphs_timed"]:
        check += " RECOMPILED-IN-TIMED-STEPS"
    return (
        f"{result['row']:<22} {result['dropout']:>4.1f} {result['ms']:9.2f} {result['tokens_per_s']:10.0f} {100 * mfu:6.2f} "
        f"{result['peak_mib']:9.0f} {result['setup_s']:7.1f} {result['first_step_s']:7.1f} {result['final_loss']:8.4f} "
        f"{result['graphs']:>3}/{result['graphs_timed']:<2} {result['graph_breaks']:>6}{check}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SIZES), default="gpt2")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--steps", type=int, default=25, help="steps per fit, warm-up included (default 25)")
    parser.add_argument("--warmup", type=int, default=5, help="first steps not timed (default 5)")
    parser.add_argument("--rows", default=DEFAULT_ROWS, help=f"comma-separated, or 'all' (default {DEFAULT_ROWS}); of {', '.join(ROWS)}")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="device peak for MFU (default 989: H200 dense bf16)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one row may take (default 300)")
    parser.add_argument("--out", default=None, help="folder for results.json and each row's log")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if not 1 <= arguments.warmup < arguments.steps:
        parser.error("give 1 <= --warmup < --steps")
    if arguments.child:
        print("RESULT " + json.dumps(child(arguments.child, arguments.model, arguments.precision, arguments.steps, arguments.warmup)))
        return
    rows = list(ROWS) if arguments.rows == "all" else arguments.rows.split(",")
    unknown = [row for row in rows if row not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; rows are {', '.join(ROWS)}")
    if arguments.out:
        os.makedirs(arguments.out, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    failures: dict[str, str] = {}
    began = time.perf_counter()

    def save() -> None:
        if arguments.out:
            with open(os.path.join(arguments.out, "results.json"), "w") as file:
                json.dump({"arguments": vars(arguments), "rows": results, "failed": list(failures), "goals": ratios()}, file, indent=1)

    def ratios() -> list[dict[str, Any]]:
        found = []
        for name, numerator, denominator, goal in GOALS:
            if numerator in results and denominator in results:
                value = results[numerator]["ms"] / results[denominator]["ms"]
                found.append({"ratio": name, "value": value, "goal": goal, "met": value <= goal})
        return found

    for row in rows:
        start = time.perf_counter()
        result, output = run_row(row, arguments)
        if arguments.out:
            with open(os.path.join(arguments.out, row.replace("/", "_").replace("+", "_") + ".log"), "w") as file:
                file.write(output)
        took = time.perf_counter() - start
        if result is None:
            failures[row] = output
            print(f"[{time.perf_counter() - began:6.0f} s] {row}: FAILED after {took:.0f} s\n{output[-3000:]}", flush=True)
        else:
            results[row] = result
            print(f"[{time.perf_counter() - began:6.0f} s] {row}: {result['ms']:.2f} ms/step, process {took:.0f} s", flush=True)
        save()

    if not results:
        sys.exit("no row ran")
    first = next(iter(results.values()))
    size = SIZES[arguments.model]
    print(
        f"\nGPT {arguments.model} {size}, {first['matmul_parameters'] / 1e6:.1f}M matmul parameters, batch {BATCH} x {size['seq_len']}, "
        f"{arguments.precision}, devices=1 on {first['device']} (torch {first['torch']}, lightning {first['lightning']}); "
        f"median of {arguments.steps - arguments.warmup} steps after {arguments.warmup} warm-up"
    )
    print(f"MFU: (6 N + 12 L H T) FLOPs/token = {first['flops_per_token'] / 1e6:.1f} MFLOP/token, against {arguments.peak_tflops:g} TFLOP/s")
    print(
        f"{'row':<22} {'drop':>4} {'ms/step':>9} {'tokens/s':>10} {'MFU %':>6} {'peak MiB':>9} {'setup s':>7} {'first s':>7} "
        f"{'loss':>8} {'graphs':>6} {'breaks':>6}"
    )
    for result in results.values():
        print(row_line(result, arguments.peak_tflops))
    for result in results.values():
        if result["strategy"] == "nnscaler" and result["compile"]:
            print(
                f"{result['row']}: executor runs compiled segments: {result['compiled_segments']}; {result['graphs']} torch.compile graphs, "
                f"{result['graphs_timed']} of them compiled during the timed steps, {result['graph_breaks']} graph breaks"
            )
        if result["fused_random_off"]:
            print(f"{result['row']}: fused random kernels turned off: {result['fused_random_off']}")
    if "auto" in results:
        for row, result in results.items():
            if result["dropout"] == 0 and row != "auto":
                difference = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(result["losses"], results["auto"]["losses"]))
                print(f"max relative loss difference {row} vs auto (dropout 0): {difference:.2e}")
    print()
    for entry in ratios():
        print(f"{entry['ratio']:<42} {entry['value']:6.3f}  goal <= {entry['goal']:<4}  {'PASS' if entry['met'] else 'not met'}")
    for name, numerator, denominator, goal in GOALS:
        if numerator not in results or denominator not in results:
            print(f"{name:<42}  (not measured: {', '.join(r for r in (numerator, denominator) if r not in results)} missing)")
    if failures:
        print(f"FAILED rows: {', '.join(failures)}")
    save()
    print(f"total {time.perf_counter() - began:.0f} s" + (f"; results in {arguments.out}/results.json" if arguments.out else ""))


if __name__ == "__main__":
    main()
