"""The analytic cluster model against published large runs: predicted vs published per-GPU throughput.

Each published run of ``paper_scale_data.RUNS`` (GPT 1.7B–1T on A100, BLOOM 176B, GPT 1.7B–462B and Llama 3
405B on H100; sources there) is simulated with ``sim.cluster.simulate_plan`` at its published tp × pp × dp and
batch, with the row's stated assumptions (microbatch, interleaving, recompute, sp, ZeRO-1, overlap). The
prediction's per-GPU TFLOP/s counts the step's FLOPs as the source does (``PublishedRun.step_flops``), so the
error is the step time's: ``predicted / published TFLOP/s - 1 = published / predicted step - 1``.

Per GPU type three large-run terms (``sim.large_run``: matmul efficiency, activation traffic, stage message
overhead) are fitted (least squares on the log ratio of step times) to two thirds of its rows; every third
row (the 2nd, 5th, 8th ... of each GPU in table order) is held out and reported apart. Reported: the error per
row, the mean absolute error on fitted and held-out rows, and Kendall's τ between predicted and published
throughput over the pairs of a GPU whose published figures differ by more than their noise (2 %; 5 % for
BLOOM's "about 150").

Run: python benchmarks/simulator_paper_scale.py [--write-specs] [--write-docs]
(``--write-specs`` puts the fitted terms into ``sim/specs/{a100,h100,h200}.yaml``, H200 taking H100's;
``--write-docs`` replaces the section between the markers in ``docs/benchmarks.md``.)
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

from lightning_nnscaler.sim import load_spec
from lightning_nnscaler.sim.analytic import TransformerShape
from lightning_nnscaler.sim.cluster import ClusterPlan, simulate_plan
from lightning_nnscaler.sim.large_run import LargeRunTerms
from lightning_nnscaler.sim.specs import SPEC_DIRECTORY

from paper_scale_data import RUNS, PublishedRun  # noqa: E402 - benchmarks/ is on sys.path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- simulator_paper_scale: begin -->", "<!-- simulator_paper_scale: end -->"
SPEC_MARK = "# Large-run terms"
BOUNDS = ([0.2, 0.0, 0.0], [1.0, 20.0, 0.02])  # matmul efficiency, activation traffic (passes), message overhead (s)
START = [0.6, 1.0, 1e-4]
NEGLIGIBLE_MESSAGE_S = 1e-6


def shape_and_plan(run: PublishedRun) -> tuple[TransformerShape, ClusterPlan]:
    """The analytic shape and plan that ``run`` is predicted as (its assumptions included)."""
    shape = TransformerShape(layers=run.simulated_layers or run.layers, hidden=run.hidden, seq_len=run.seq_len, vocab=run.vocab,
                             heads=run.heads, global_batch=run.global_batch, embeddings=run.embeddings)
    plan = ClusterPlan(dp=run.dp, tp=run.tp, pp=run.pp, microbatch_size=run.microbatch, recompute=run.recompute, zero1=run.zero1,
                       sequence_parallel=run.sequence_parallel and run.tp > 1, virtual_stages=run.virtual_stages,
                       overlap_grad_reduce=run.overlap_grad_reduce, overlap_tp_comm=run.overlap_tp_comm)
    return shape, plan


def predicted_seconds(run: PublishedRun, terms: LargeRunTerms) -> float:
    """The simulated step of ``run`` on its GPU's spec with ``terms`` applied."""
    shape, plan = shape_and_plan(run)
    return simulate_plan(shape, terms.apply(load_spec(run.gpu)), plan).step_seconds


def log_errors(values: Sequence[float], runs: Sequence[PublishedRun]) -> np.ndarray:
    """log(predicted / published step) of each run under the terms ``values``."""
    terms = LargeRunTerms(*values)
    return np.array([np.log(predicted_seconds(run, terms) / run.published_step_seconds()) for run in runs])


def fit(runs: Sequence[PublishedRun]) -> LargeRunTerms:
    """The terms that fit ``runs`` best (least squares on the log step ratios, finite differences)."""
    result = least_squares(log_errors, START, bounds=BOUNDS, args=(runs,), diff_step=1e-3, x_scale=[0.1, 1.0, 1e-3],
                           xtol=1e-4, ftol=1e-5)
    return LargeRunTerms(*map(float, result.x))


def held_out(runs: Sequence[PublishedRun]) -> list[bool]:
    """Per run: whether it is held out of the fit (every third row of its GPU, from the second)."""
    seen: dict[str, int] = {}
    flags = []
    for run in runs:
        flags.append(seen.get(run.gpu, 0) % 3 == 1)
        seen[run.gpu] = seen.get(run.gpu, 0) + 1
    return flags


def kendall_tau(rows: Sequence[dict]) -> tuple[float, int]:
    """Kendall's τ between predicted and published TFLOP/s over the pairs whose published figures differ by
    more than their noise, and the number of such pairs (τ nan without one)."""
    concordant = discordant = 0
    for first, second in itertools.combinations(rows, 2):
        gap = first["published"] - second["published"]
        if abs(gap) <= first["noise"] * first["published"] + second["noise"] * second["published"]:
            continue
        if gap * (first["predicted"] - second["predicted"]) > 0:
            concordant += 1
        else:
            discordant += 1
    pairs = concordant + discordant
    return ((concordant - discordant) / pairs if pairs else float("nan")), pairs


def evaluate_rows(runs: Sequence[PublishedRun], terms: dict[str, LargeRunTerms], flags: Sequence[bool]) -> list[dict]:
    """One row per run: published and predicted TFLOP/s, error, whether held out."""
    rows = []
    for run, out in zip(runs, flags, strict=True):
        seconds = predicted_seconds(run, terms[run.gpu])
        predicted = run.step_flops() / (run.gpus * seconds) / 1e12
        rows.append({"run": run, "held_out": out, "published": run.tflops, "predicted": predicted, "seconds": seconds,
                     "error": predicted / run.tflops - 1, "noise": run.noise})
    return rows


def summary(rows: Sequence[dict]) -> dict[str, str]:
    """Per GPU: MAE on fitted and held-out rows and τ, as text (also the calibration line of its spec)."""
    lines = {}
    for gpu in sorted({row["run"].gpu for row in rows}):
        mine = [row for row in rows if row["run"].gpu == gpu]
        fitted, out = [row for row in mine if not row["held_out"]], [row for row in mine if row["held_out"]]
        mae = {name: np.mean([abs(row["error"]) for row in part]) for name, part in (("fit", fitted), ("held", out))}
        tau, pairs = kendall_tau(mine)
        tau_out, pairs_out = kendall_tau(out)
        sources = "; ".join(sorted({row["run"].source for row in mine}))
        lines[gpu] = (f"fitted to {len(fitted)} published runs, mean absolute error {mae['fit']:.1%}; {len(out)} held out, "
                      f"{mae['held']:.1%}; Kendall tau {tau:.2f} over {pairs} pairs (held out {tau_out:.2f}, {pairs_out} pairs); "
                      f"sources: {sources}")
    return lines


def markdown(rows: Sequence[dict], terms: dict[str, LargeRunTerms], lines: dict[str, str], seconds: float) -> str:
    """The docs section: the table, the fitted terms and the summary lines."""
    out = ["| run | GPU | GPUs | tp × pp × dp | batch | assumed v / microbatch / recompute | published TFLOP/s | "
           "predicted | error | set | source |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        run = row["run"]
        out.append(f"| {run.name} | {run.gpu.upper()} | {run.gpus:,} | {run.tp} × {run.pp} × {run.dp} | {run.global_batch} | "
                   f"{run.virtual_stages} / {run.microbatch} / {run.recompute} | {run.tflops:g} | {row['predicted']:.1f} | "
                   f"{row['error']:+.1%} | {'held out' if row['held_out'] else 'fit'} | {run.source} |")
    out.append("")
    for gpu, term in terms.items():
        out.append(f"- {gpu.upper()}: matmul efficiency {term.matmul_efficiency:.3f}, activation traffic "
                   f"{term.activation_traffic:.2f} passes, stage message overhead {term.message_overhead_s * 1e3:.3f} ms; {lines[gpu]}.")
    out.append(f"- Fit and table in {seconds:.0f} s (load average {os.getloadavg()[0]:.1f}); "
               f"`python benchmarks/simulator_paper_scale.py`, {datetime.date.today().isoformat()}.")
    return "\n".join(out)


def write_docs(section: str) -> None:
    """Replace the text between the markers in ``docs/benchmarks.md`` with ``section``."""
    text = DOCS.read_text()
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{DOCS} has no {BEGIN} ... {END} section")
    DOCS.write_text(pattern.sub(lambda _: f"{BEGIN}\n{section}\n{END}", text))


def write_spec(name: str, terms: LargeRunTerms, comment: str) -> None:
    """Replace (or add) the large-run section at the end of ``sim/specs/<name>.yaml`` (a message overhead under
    ``NEGLIGIBLE_MESSAGE_S`` written as 0, which spares the simulation its tasks)."""
    if terms.message_overhead_s < NEGLIGIBLE_MESSAGE_S:
        terms = LargeRunTerms(terms.matmul_efficiency, terms.activation_traffic, 0.0, terms.calibration)
    path = SPEC_DIRECTORY / f"{name}.yaml"
    text = path.read_text()
    head = text[: text.index(SPEC_MARK)] if SPEC_MARK in text else text
    calibration = terms.calibration.replace('"', "'")
    path.write_text(head.rstrip("\n") + f"\n{SPEC_MARK} ({comment}; sim.large_run): per-GPU throughput of\n"
                    "# published large training runs (rows, sources and assumptions: benchmarks/paper_scale_data.py; sources and\n"
                    "# error in `calibration`). The analytic cluster model (sim.cluster) prices with them; traced plans keep the\n"
                    "# kernel-level figures above.\n"
                    f"large_run:\n  matmul_efficiency: {terms.matmul_efficiency:.4f}\n"
                    f"  activation_traffic: {terms.activation_traffic:.4f}\n"
                    f"  message_overhead_s: {terms.message_overhead_s:.4e}\n  calibration: \"{calibration}\"\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-specs", action="store_true")
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--gpu", action="append", help="fit only this GPU's rows (a100, h100); repeatable")
    args = parser.parse_args()
    start = time.perf_counter()
    runs = [run for run in RUNS if not args.gpu or run.gpu in args.gpu]
    flags = held_out(runs)
    terms = {}
    for gpu in sorted({run.gpu for run in runs}):
        terms[gpu] = fit([run for run, out in zip(runs, flags, strict=True) if run.gpu == gpu and not out])
        print(f"{gpu}: fitted {terms[gpu]} in {time.perf_counter() - start:.0f} s", flush=True)
    rows = evaluate_rows(runs, terms, flags)
    lines = summary(rows)
    terms = {gpu: LargeRunTerms(term.matmul_efficiency, term.activation_traffic, term.message_overhead_s,
                                f"large-run terms {lines[gpu]}") for gpu, term in terms.items()}
    section = markdown(rows, terms, lines, time.perf_counter() - start)
    print(section)
    stamp = f"fitted by benchmarks/simulator_paper_scale.py on {datetime.date.today().isoformat()}"
    if args.write_specs:
        if set(terms) != {"a100", "h100"}:
            raise SystemExit("--write-specs needs every GPU's fit: leave out --gpu")
        for gpu, term in terms.items():
            write_spec(gpu, term, stamp)
        h100 = terms["h100"]
        write_spec("h200", LargeRunTerms(h100.matmul_efficiency, h100.activation_traffic, h100.message_overhead_s,
                                         "H100's large-run terms (no published H200 large-run throughput verified): " + h100.calibration),
                   f"H100's terms, {stamp}: the H200 has the H100's compute and links")
    if args.write_docs:
        write_docs(section)


if __name__ == "__main__":
    main()
