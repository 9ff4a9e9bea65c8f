"""Parallelization recipes: short functions over a graph that call only op_trans, op_assign, op_order.

Each recipe is ``recipe(graph, ctx, config) -> None``, its parameters the fields of a frozen keyword-only
config dataclass (``plans.parameters``), and is catalogued in ``recipes/*.yaml``;
``apply_recipe(graph, name, world_size, **params)`` converts the parameters to the config, plans and validates.
"""

from lightning_nnscaler.plans.catalog import RecipeError, RecipeSpec, apply_recipe, list_recipes, load_recipe
from lightning_nnscaler.plans.context import PlanContext
from lightning_nnscaler.plans.coshard import coshard
from lightning_nnscaler.plans.coverage import CoverageReport, PartialPlanWarning, check_coverage
from lightning_nnscaler.plans.dp import dp
from lightning_nnscaler.plans.hybrid import hybrid
from lightning_nnscaler.plans.megatron_tp import tp
from lightning_nnscaler.plans.sequence import sp
from lightning_nnscaler.plans.zero import zero1, zero3

__all__ = [
    "CoverageReport", "PartialPlanWarning", "PlanContext", "RecipeError", "RecipeSpec", "apply_recipe", "check_coverage", "coshard",
    "dp", "hybrid", "list_recipes", "load_recipe", "sp", "tp", "zero1", "zero3",
]
