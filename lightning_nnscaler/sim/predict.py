"""``predict(plan, spec)``: a plan's simulated step time and per-rank memory, from the same programs the runtime runs."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from lightning_nnscaler.explain import MEMORY_KEYS, human_bytes
from lightning_nnscaler.ir.op import Op
from lightning_nnscaler.sim.costs import CommModel, ComputeModel, OpTime, Roofline
from lightning_nnscaler.sim.from_plan import plan_task_lists
from lightning_nnscaler.sim.results import RankStats
from lightning_nnscaler.sim.simulate import Machine, SimResult, simulate
from lightning_nnscaler.sim.specs import HardwareSpec, load_spec


@dataclass
class DeviceModel:
    """Compute costs on one device kind: per-op times from ``ops`` (a roofline or a profile), the AdamW
    step and piece copies from the spec's roofline, or from ``optimizer_fit`` when one was measured; all
    of them times the spec's ``in_step_factor`` for ``world_size`` ranks (what a training step adds to work timed alone)."""

    spec: HardwareSpec
    ops: ComputeModel
    optimizer_fit: tuple[float, float] | None = None
    """Measured AdamW cost: (seconds per tensor, seconds per element)."""
    world_size: int | None = None
    """The ranks of the run priced (``predict`` sets it to the plan's); None: the spec's first in-step figure."""

    @property
    def factor(self) -> float:
        """What a training step of ``world_size`` ranks adds to work timed alone (``HardwareSpec.in_step``)."""
        return self.spec.in_step(self.world_size)

    def for_ranks(self, world_size: int) -> "DeviceModel":
        """This model pricing a run of ``world_size`` ranks (the same op costs and profile)."""
        return self if world_size == self.world_size else replace(self, world_size=world_size)

    def op_time(self, op: Op) -> OpTime:
        """Forward and backward seconds of ``op``."""
        alone = self.ops.op_time(op)
        factor = self.factor
        return alone if factor == 1.0 else OpTime(alone.forward * factor, alone.backward * factor)

    def optimizer_seconds(self, tensor_numels: list[int]) -> float:
        """One AdamW step over tensors of ``tensor_numels`` elements."""
        fit = self.optimizer_fit or self.spec.optimizer
        if fit is not None:
            per_tensor, per_element = fit
            return self.factor * (per_tensor * len(tensor_numels) + per_element * sum(tensor_numels))
        roofline = Roofline(self.spec)
        return self.factor * sum(roofline.optimizer_seconds(numel) for numel in tensor_numels)

    def copy_seconds(self, nbytes: int) -> float:
        """Copying ``nbytes`` (read and write) on the device."""
        return self.factor * (self.spec.op_overhead_s + 2 * nbytes / (self.spec.memory_bandwidth * self.spec.memory_efficiency))


@dataclass
class Prediction:
    """A plan's simulated step and memory per rank (bytes: explain's static rows with the simulated activation peak)."""

    simulation: SimResult
    memory: list[dict[str, int]]
    spec_name: str = ""

    @property
    def step_seconds(self) -> float:
        """Simulated seconds of one training step."""
        return self.simulation.step_seconds

    def summary(self) -> str:
        """One line: the simulated step, its bubble (the share of all ranks' step time not computing: communicating or idle;
        not the schedule's theoretical bubble that ``explain_pipeline`` prints) and the busiest rank's compute, communication
        and idle shares."""
        ranks = self.simulation.ranks
        step = self.step_seconds or 1.0
        worst = max(range(len(ranks)), key=lambda rank: ranks[rank].communication + ranks[rank].idle)
        stats = ranks[worst]
        return (f"predicted step on {self.spec_name}: {self.step_seconds * 1e3:.3f} ms (simulated; bubble {self.simulation.bubble_fraction:.1%} "
                f"of all ranks' step time not computing, i.e. communicating or idle; "
                f"rank {worst}: compute {stats.busy / step:.0%}, communication {stats.communication / step:.0%}, idle {stats.idle / step:.0%}); "
                f"peak memory {human_bytes(max(self.peak_bytes))} on the fullest rank")

    @property
    def peak_bytes(self) -> list[int]:
        """Per rank, the sum of the memory columns (``explain.MEMORY_KEYS``)."""
        return [sum(row[key] for key in MEMORY_KEYS) for row in self.memory]

    def rank_rows(self) -> list[dict[str, float]]:
        """Per rank: simulated ``busy_ms`` (compute), ``communication_ms`` and ``idle_ms`` of one step, and ``peak_bytes``."""
        return [
            {"busy_ms": stats.busy * 1e3, "communication_ms": stats.communication * 1e3, "idle_ms": stats.idle * 1e3, "peak_bytes": peak}
            for stats, peak in zip(self.simulation.ranks, self.peak_bytes, strict=True)
        ]

    def table(self) -> str:
        """The per-rank rows (``rank_rows``) as text, then the ``summary`` line."""
        lines = [f"predicted per rank on {self.spec_name}:", f"{'rank':>4} {'busy ms':>12} {'comm ms':>12} {'idle ms':>12} {'peak memory':>12}"]
        for rank, row in enumerate(self.rank_rows()):
            times = " ".join(f"{row[key]:>12.3f}" for key in ("busy_ms", "communication_ms", "idle_ms"))
            lines.append(f"{rank:>4} {times} {human_bytes(row['peak_bytes']):>12}")
        return "\n".join([*lines, self.summary()])


def _at_the_peak(row: dict[str, int], stats: RankStats, zero_stage: int) -> dict[str, int]:
    """``row`` (explain's, every gradient counted) as the rank is at its simulated fullest: activations their kept
    peak; of the gradients the backward makes (``stats.gradient_bytes``: in explain's gradients, or under ZeRO the
    full ones in its transient column) those made by then; what else is in flight added to ``transient``; under
    ZeRO no reduced chunk's gradient (those come after backward, when its activations are gone)."""
    made, held = stats.gradients_at_peak, stats.gradient_bytes
    in_flight = max(stats.peak_live_bytes - stats.peak_activation_bytes - made, 0)
    memory = {**{key: row[key] for key in MEMORY_KEYS}, "activations": stats.peak_activation_bytes}
    if zero_stage:
        memory["gradients"] = 0
        memory["transient"] = max(row["transient"] - held, 0) + made + in_flight
    else:
        memory["gradients"] = max(row["gradients"] - held, 0) + made
        memory["transient"] = row["transient"] + in_flight
    return memory


def predict(plan: Any, spec: HardwareSpec | str = "a100", device: DeviceModel | None = None, *, record: bool = False) -> Prediction:
    """Simulate one training step of ``plan`` on ``spec`` (default costs: its roofline).

    Memory per rank is ``plan.memory_rows()`` (parameters, gradients, optimizer, transient) with
    ``activations`` replaced by the simulated peak of activations kept for backward over the rank's list, and
    ``transient`` raised by what the step holds beyond them at its fullest (``sim.transient``: outputs not yet
    freed, gradients in flight), so that the columns add up to the allocator's peak.
    """
    spec = load_spec(spec) if isinstance(spec, str) else spec
    device = (device or DeviceModel(spec, Roofline(spec))).for_ranks(plan.materialized.world_size)
    lists = plan_task_lists(plan, device)
    machine = Machine(spec.ranks_per_node, spec.cores_per_node, spec.busy_issue_s, spec.late_receive_seconds(len(lists)),
                      *spec.jitter(len(lists)))
    result = simulate(lists, CommModel(spec, len(lists)), machine, record=record)
    memory = []
    for row, stats in zip(plan.memory_rows(), result.ranks, strict=True):
        memory.append(_at_the_peak(row, stats, plan.zero_stage))
    return Prediction(result, memory, spec.name)
