"""Large-run terms: what a GPU spec's ``large_run`` section says a paper-scale training step costs, fitted to
published per-GPU throughput of large training runs (``benchmarks/simulator_paper_scale.py``, its data in
``benchmarks/paper_scale_data.py``), and the calibration error measured there.

The analytic cluster model (``sim.cluster``) prices a step with them; the spec's top-level efficiencies stay
the kernel-level figures (H100, H200: fitted to one GPU's kernels of a GPT-2 124M step by
``benchmarks/gpu_spec_check.py``) that traced small plans are predicted with and tested against. The two differ
for a reason: a published per-GPU throughput holds what a kernel timing does not (the framework between kernels,
the exposed tensor-parallel collectives on a loaded NVLink fabric, a real fabric's bandwidth, data loading and
logging), so a fit to it lands below the kernels' share of peak FLOP/s.

A ``large_run`` section has three fitted numbers: ``matmul_efficiency`` (share of peak FLOP/s a block's matmuls
reach, in place of the spec's), ``activation_traffic`` (the memory-bound work of a block's other kernels —
layer norms, GeLU, dropout, softmax, residual adds — as that many passes over the bytes the block's forward
keeps for backward, Korthikanti et al. 2022 Table 2, at the spec's memory bandwidth × ``memory_efficiency``; the
analytic model has no such term otherwise) and ``message_overhead_s`` (what each message between pipeline stages
holds its sender and its receiver beyond its transfer: Megatron posts a stage's sends and receives as one batch
and synchronizes the device after it, ``p2p_communication._communicate``, so the next kernels wait for it); the
spec's ``op_overhead_s`` and links stay. And ``calibration``: a line stating the rows, sources and error of the fit.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from lightning_nnscaler.sim.specs import SPEC_DIRECTORY, HardwareSpec, available_specs, load_spec

SUFFIX = " (large-run terms)"
"""Appended to the name of a spec with its large-run terms applied."""


@dataclass(frozen=True)
class LargeRunSpec(HardwareSpec):
    """A spec with its large-run terms applied: ``activation_traffic`` and ``message_overhead_s`` are the terms
    ``HardwareSpec`` lacks."""

    activation_traffic: float = field(default=0.0, kw_only=True)
    message_overhead_s: float = field(default=0.0, kw_only=True)


@dataclass(frozen=True)
class LargeRunTerms:
    """A spec's fitted large-run terms (see the module docstring) and its calibration line."""

    matmul_efficiency: float
    activation_traffic: float
    message_overhead_s: float
    calibration: str = ""

    def apply(self, spec: HardwareSpec) -> LargeRunSpec:
        """``spec`` with these terms: its matmul efficiency replaced, its blocks' memory-bound work and its stage
        messages' overhead priced."""
        base = {name: getattr(spec, name) for name in HardwareSpec.__dataclass_fields__}
        base["name"] = spec.name.removesuffix(SUFFIX) + SUFFIX
        base["matmul_efficiency"] = self.matmul_efficiency
        return LargeRunSpec(**base, activation_traffic=self.activation_traffic, message_overhead_s=self.message_overhead_s)


def terms_from_dict(data: dict | None) -> LargeRunTerms | None:
    """The ``large_run`` mapping of a spec file as terms; None without one."""
    if not data:
        return None
    return LargeRunTerms(float(data["matmul_efficiency"]), float(data["activation_traffic"]),
                         float(data["message_overhead_s"]), str(data.get("calibration", "")))


@functools.lru_cache(maxsize=64)
def _terms_in(path: Path) -> LargeRunTerms | None:
    return terms_from_dict(yaml.safe_load(path.read_text()).get("large_run"))


def _spec_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    return SPEC_DIRECTORY / f"{name_or_path.lower()}.yaml" if not path.suffix else path


def large_run_terms(spec: str | HardwareSpec) -> LargeRunTerms | None:
    """The large-run terms of ``spec``: a shipped spec's name or a YAML path, or a loaded spec (matched to the
    shipped file of its name); None when its file has no ``large_run`` section."""
    if isinstance(spec, str):
        path = _spec_path(spec)
        return _terms_in(path) if path.is_file() else None
    shipped = _shipped_by_name().get(spec.name.removesuffix(SUFFIX))
    return _terms_in(_spec_path(shipped)) if shipped is not None else None


@functools.lru_cache(maxsize=1)
def _shipped_by_name() -> dict[str, str]:
    """The shipped specs' files by the device name they state."""
    return {load_spec(shipped).name: shipped for shipped in available_specs()}


def cluster_spec(spec: str | HardwareSpec, *, large_run: bool = True) -> HardwareSpec:
    """The spec the analytic cluster model prices a plan on: ``spec`` (loaded when a name or path) with its
    large-run terms applied when ``large_run`` and it has them, as it is otherwise."""
    hardware = load_spec(spec) if isinstance(spec, str) else spec
    terms = large_run_terms(spec) if large_run else None
    return terms.apply(hardware) if terms is not None else hardware
