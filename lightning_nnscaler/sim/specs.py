"""Hardware specs: peak FLOP/s per dtype, memory bandwidth, links, in YAML files shipped with the package.

``load_spec("a100")`` reads ``specs/a100.yaml``; a path to any YAML file with the same keys works too
(a hypothetical cluster). ``cpu.yaml`` is measured on a development machine by
``benchmarks/calibrate_comm.py`` and carries fitted collective figures (``collectives``) and the
cores its ranks share (``cores_per_node``); the GPU files come from public datasheets (cited in each).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

SPEC_DIRECTORY = Path(__file__).resolve().parent / "specs"
FALLBACK_GPU_SPEC = "a100"
"""What a GPU without a shipped spec is predicted on (``predict``'s default: the most common data-centre GPU)."""

T = TypeVar("T")


@dataclass(frozen=True)
class Link:
    """One link kind: bandwidth in bytes/s (one direction) and latency in seconds."""

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class HardwareSpec:
    """A device kind and how its ranks connect.

    Attributes:
        name: the device's name.
        memory_bytes: device memory.
        peak_flops: FLOP/s by dtype name (``float32``, ``bfloat16``, ...).
        memory_bandwidth: bytes/s of device memory.
        matmul_efficiency: share of ``peak_flops`` that large matmuls reach.
        memory_efficiency: share of ``memory_bandwidth`` that memory-bound ops reach.
        op_overhead_s: fixed time per op (launch, framework dispatch).
        ranks_per_node: ranks on one node (they use ``intra_node`` links).
        cores_per_node: compute slots a node's ranks share (CPU); None: one device per rank.
        in_step_factor: how much longer an op (and the optimizer's step) takes inside a training step on its
            rank than timed alone (measured by ``benchmarks/calibrate_comm.py`` in steps of small plans), one figure
            or one per world size (on shared cores more ranks than cores slow every op); 1.0 where unmeasured.
        busy_issue_s: with ``cores_per_node`` set, how long issuing a send or starting an asynchronous collective holds a rank
            while the node's other cores all compute (the backend's communication thread waits for a core first);
            measured in training steps by ``benchmarks/calibrate_comm.py`` (``sim.in_step``).
        late_receive_s: with ``cores_per_node`` set, by world size, how long a receive posted after its message was
            sent takes (gloo moves the message when the receive asks for it, so the sender's communication
            thread must get a core first); the mean measured in training steps by ``benchmarks/calibrate_comm.py``.
        jitter_s: with ``cores_per_node`` set, by world size, ``(seconds, share)``: how uncertain a rank's clock is
            in a step, as a standard deviation, ``seconds`` when it leaves a wait for other ranks plus ``share`` ×
            the compute it ran since (``sim.jitter``: ranks that must meet wait for the latest of them); measured by
            ``benchmarks/calibrate_comm.py`` from how far apart the ranks of its plans reach their collectives
            (``sim.in_step.arrival_spreads``); none where unmeasured.
        intra_node, inter_node: the links within and across nodes.
        collectives: fitted ``{kind: {group size: [alpha, beta]}}`` (``time = alpha + beta × ring bytes``);
            ``p2p`` is the point-to-point fit. Missing entries fall back to ring formulas over the links.
    """

    name: str
    memory_bytes: float
    peak_flops: dict[str, float]
    memory_bandwidth: float
    matmul_efficiency: float
    memory_efficiency: float
    op_overhead_s: float
    ranks_per_node: int
    intra_node: Link
    inter_node: Link
    cores_per_node: int | None = None
    busy_issue_s: float = 0.0
    in_step_factor: float | dict[int, float] = 1.0
    late_receive_s: dict[int, float] = field(default_factory=dict)
    jitter_s: dict[int, tuple[float, float]] = field(default_factory=dict)
    collectives: dict[str, dict[int, tuple[float, float]]] = field(default_factory=dict)
    optimizer: tuple[float, float] | None = None
    """Measured AdamW step: (seconds per tensor, seconds per element); None: the roofline's memory-bound estimate."""

    def late_receive_seconds(self, world_size: int) -> float:
        """``late_receive_s`` for a run of ``world_size`` ranks (``measured_for``; 0 without an entry)."""
        return measured_for(self.late_receive_s, world_size) or 0.0

    def jitter(self, world_size: int) -> tuple[float, float]:
        """``jitter_s`` for a run of ``world_size`` ranks (``measured_for``; none without an entry)."""
        return measured_for(self.jitter_s, world_size) or (0.0, 0.0)

    def in_step(self, world_size: int | None) -> float:
        """``in_step_factor`` for a run of ``world_size`` ranks (``measured_for``; the fewest ranks measured when
        None; 1.0 without an entry)."""
        if not isinstance(self.in_step_factor, dict):
            return self.in_step_factor
        if not self.in_step_factor:
            return 1.0
        return measured_for(self.in_step_factor, world_size if world_size is not None else min(self.in_step_factor)) or 1.0

    def flops(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype`` (float32's when the spec lists no figure for it)."""
        return self.peak_flops.get(dtype, self.peak_flops["float32"])


def measured_for(table: dict[int, T], world_size: int) -> T | None:
    """A by-world-size calibration entry for a run of ``world_size`` ranks: the one measured with the most ranks
    not above it (on shared cores a cost grows with the ranks keeping the cores busy); None without one."""
    measured = [ranks for ranks in table if ranks <= max(world_size, 2)]
    return table[max(measured)] if measured else None


def available_specs() -> list[str]:
    """The names of the shipped specs (``load_spec`` accepts each)."""
    return sorted(path.stem for path in SPEC_DIRECTORY.glob("*.yaml"))


def spec_for_device(device_name: str) -> tuple[str, str]:
    """The shipped spec to predict a run on ``device_name`` with, and a note when none matches.

    ``"cpu"`` gets the measured ``cpu`` spec; a GPU gets the shipped spec whose name is a word of its own
    (``"NVIDIA H100 80GB HBM3"``: ``h100``; ``"NVIDIA RTX A1000"`` is no A100), else ``FALLBACK_GPU_SPEC``
    with a note naming the device.
    """
    name = device_name.lower()
    if name == "cpu":
        return "cpu", ""
    for spec in available_specs():
        if spec != "cpu" and re.search(rf"\b{re.escape(spec)}\b", name):
            return spec, ""
    return FALLBACK_GPU_SPEC, f"no shipped spec matches {device_name!r}: predicted on {FALLBACK_GPU_SPEC}"


def load_spec(name_or_path: str | os.PathLike[str]) -> HardwareSpec:
    """The shipped spec ``name_or_path`` (``"h100"``) or the spec in that YAML file.

    Raises:
        FileNotFoundError: naming the shipped specs when there is no such spec.
        ValueError: naming the missing keys of an incomplete file.
    """
    path = Path(name_or_path)
    if not path.suffix:
        path = SPEC_DIRECTORY / f"{str(name_or_path).lower()}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"no hardware spec {str(name_or_path)!r}: shipped specs are {available_specs()}, or give a YAML file's path")
    return spec_from_dict(yaml.safe_load(path.read_text()), source=str(path.name))


def spec_from_dict(data: dict[str, Any], source: str = "spec") -> HardwareSpec:
    """A ``HardwareSpec`` from the parsed YAML mapping (see ``HardwareSpec`` for the keys)."""
    required = ("name", "memory_bytes", "peak_flops", "memory_bandwidth", "links")
    missing = [key for key in required if key not in data]
    if missing:
        raise ValueError(f"hardware spec {source} lacks {missing}")
    links = data["links"]
    collectives = {
        kind: {int(size): (float(fit[0]), float(fit[1])) for size, fit in sizes.items()}
        for kind, sizes in (data.get("collectives") or {}).items()
    }
    return HardwareSpec(
        name=str(data["name"]),
        memory_bytes=float(data["memory_bytes"]),
        peak_flops={dtype: float(value) for dtype, value in data["peak_flops"].items()},
        memory_bandwidth=float(data["memory_bandwidth"]),
        matmul_efficiency=float(data.get("matmul_efficiency", 1.0)),
        memory_efficiency=float(data.get("memory_efficiency", 1.0)),
        op_overhead_s=float(data.get("op_overhead_s", 0.0)),
        ranks_per_node=int(data.get("ranks_per_node", 8)),
        intra_node=Link(float(links["intra_node"]["bandwidth"]), float(links["intra_node"]["latency"])),
        inter_node=Link(float(links["inter_node"]["bandwidth"]), float(links["inter_node"]["latency"])),
        cores_per_node=None if data.get("cores_per_node") is None else int(data["cores_per_node"]),
        busy_issue_s=float(data.get("busy_issue_s", 0.0)),
        in_step_factor=_by_world_size_or_one(data.get("in_step_factor", 1.0)),
        late_receive_s={int(ranks): float(seconds) for ranks, seconds in (data.get("late_receive_s") or {}).items()},
        jitter_s=_jitter_entries(data.get("jitter_s") or {}, source),
        collectives=collectives,
        optimizer=None if data.get("optimizer") is None else (float(data["optimizer"][0]), float(data["optimizer"][1])),
    )


def _jitter_entries(table: dict[Any, Any], source: str) -> dict[int, tuple[float, float]]:
    """``jitter_s`` as ``{ranks: (seconds, share)}``; an entry of another form is refused by name."""
    entries = {}
    for ranks, fit in table.items():
        if not isinstance(fit, (list, tuple)) or len(fit) != 2:
            raise ValueError(f"hardware spec {source}: jitter_s[{ranks}] is {fit!r}; give [seconds, share] "
                             "(the clock spread at each meeting of ranks, and its share of the compute since)")
        entries[int(ranks)] = (float(fit[0]), float(fit[1]))
    return entries


def _by_world_size_or_one(value: Any) -> float | dict[int, float]:
    """A spec figure given once or per world size (``{ranks: figure}``)."""
    if isinstance(value, dict):
        return {int(ranks): float(figure) for ranks, figure in value.items()}
    return float(value)
