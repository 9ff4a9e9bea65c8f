"""Capture and op_trans speed on GPT-2 124M (12 layers, hidden 768, seq 1024, vocab 50257).

Goals on a 2-core machine: trace + annotate < 10 s; op_trans of every op into 8 parts < 2 s.
Run: python benchmarks/capture.py
"""

from __future__ import annotations

import time

import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.ir.annotation import DimAnnotation
from lightning_nnscaler.models.gpt import GPT, GPTConfig

PARTS = 8


def split_choice(op: lnn.Op) -> str:
    """The first splittable dim that 8 divides, else 'value', else 'replicate'."""
    if op.annotation is None:
        return "replicate"
    annotation = DimAnnotation.parse(op.annotation)
    sizes = annotation.name_sizes([piece.shape for piece in op.tensor_inputs], [piece.shape for piece in op.outputs])
    for name in annotation.splittable_names():
        if sizes[name] % PARTS == 0:
            return name
    return "value" if annotation.value_inputs else "replicate"


def main() -> None:
    torch.manual_seed(0)
    config = GPTConfig.gpt2_124m()
    model = GPT(config)
    batch = model.example_batch(1)

    start = time.perf_counter()
    graph = lnn.trace(model, batch, step="training_step")
    trace_seconds = time.perf_counter() - start
    annotated = sum(op.annotation is not None for op in graph.ops)

    choices = [(op.name, split_choice(op)) for op in graph.ops]
    start = time.perf_counter()
    for name, choice in choices:
        lnn.op_trans(graph, name, choice, PARTS)
    trans_seconds = time.perf_counter() - start
    kinds = {choice for _, choice in choices}

    rows = [
        ("trace + annotate (s)", trace_seconds, 10.0),
        (f"op_trans x{PARTS} of {len(choices)} ops (s)", trans_seconds, 2.0),
    ]
    print(f"GPT-2 124M: {len(choices)} ops, {annotated} annotated, {len(graph.ops)} pieces; split kinds used: {sorted(kinds)}")
    print(f"{'measure':<34} {'ours':>8} {'goal':>8} {'ours/goal':>10}")
    for label, value, goal in rows:
        print(f"{label:<34} {value:8.2f} {goal:8.2f} {value / goal:10.2f}")


if __name__ == "__main__":
    main()
