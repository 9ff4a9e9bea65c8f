"""PlanContext: what a recipe knows about the run besides the graph, and what it may set for the runtime."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_nnscaler.plans.layout import RecipeLayout
from lightning_nnscaler.plans.stage_cuts import OpPrices
from lightning_nnscaler.schedules import Action, Schedule

ZERO_STAGES = (0, 1, 3)


@dataclass(frozen=True)
class PipelinePlan:
    """A pipelined plan's schedule over the pipeline axis, and each rank's place on that axis."""

    schedule: Schedule
    """Compute actions per pipeline position (``schedule.actions[column]``); stage ``s`` on column ``schedule.stage_ranks[s]``."""
    column_of_rank: tuple[int, ...]
    """Each rank's pipeline position (its ``pp`` coordinate): the schedule list it runs."""
    stage_work: tuple[tuple[int, float], ...] = ()
    """``(stage, share)`` of the work the stage cut balanced, per cut stage (``explain``); empty where the recipe did not say."""
    priced_by: str = "estimate"
    """What priced ``stage_work``: ``estimate`` (from shapes) or ``measured`` (op times on the run's device)."""

    def actions(self, rank: int) -> tuple[Action, ...]:
        """The compute actions ``rank`` runs, in order."""
        return self.schedule.actions[self.column_of_rank[rank]]


@dataclass
class PlanContext:
    """The run a recipe plans for; a recipe reads ``world_size`` and may set the runtime options."""

    world_size: int
    """Number of devices (ranks); every op must end up on one of ``0..world_size-1``."""
    layout: RecipeLayout | None = None
    """What the recipe's layout function promised for this run (its device grid); None when the
    recipe is called directly, not through ``apply_recipe``. The plan's layout: which batch rows each
    rank's code reads (``auto`` replaces it with its winner's)."""
    zero_stage: int = 0
    """ZeRO sharding over the data-parallel group, a runtime option a recipe may set: 0 = none,
    1 = optimizer state sharded, 3 = optimizer state and parameters sharded."""

    measured_prices: OpPrices | None = None
    """Each op's measured forward and backward seconds on the run's device, the same on every rank (``plan.parallelize``
    measures them when a recipe asks, the strategy shares rank 0's): what ``balance="measured"`` cuts stages by."""

    pipeline: PipelinePlan | None = None
    """Set by pipelined recipes: the schedule that orders each rank's segments."""

    search: Any = None
    """Set by the ``auto`` recipe: the search that chose the plan (``sim.search.SearchResult``: the ranked
    candidates and the winner)."""

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or isinstance(self.world_size, bool) or self.world_size < 1:
            raise ValueError(f"PlanContext.world_size must be a positive int, got {self.world_size!r}")
        if self.zero_stage not in ZERO_STAGES:
            raise ValueError(f"PlanContext.zero_stage must be one of {ZERO_STAGES}, got {self.zero_stage!r}")
