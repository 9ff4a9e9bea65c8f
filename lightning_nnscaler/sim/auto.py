"""The ``auto`` recipe: search the catalog's plans with the simulator (``sim.search``), then apply the winner.

Its declared layout (what the DataLoader loads, known before any batch is traced and searched) is every
rank its own replica, as under ddp: the step is planned for all ranks' rows together. Applying the winner
sets the plan's layout to the winner's own grid (data-parallel replicas, head pieces), which says which
rows each rank's code reads; where the two differ, ``NnScalerStrategy`` gathers each rank's rows from
the ranks that loaded them before the step (``strategy.planning.gather_replica_batch``).
"""

from __future__ import annotations

from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.plans.context import PlanContext
from lightning_nnscaler.sim.search import search
from lightning_nnscaler.sim.specs import available_specs

CUDA_SPECS = ("h200", "h100", "a100", "v100")
"""Shipped GPU specs, matched against the CUDA device's name (the first that appears in it)."""


def machine_spec() -> str:
    """The shipped spec of this machine: the CUDA device's (``"h100"``, ...) when there is one, else ``"cpu"``.

    Raises:
        ValueError: a CUDA device that no shipped spec describes (pass ``spec=`` a YAML path then).
    """
    import torch  # only when no spec is given

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    for spec in CUDA_SPECS:
        if spec in name:
            return spec
    raise ValueError(f"auto: no shipped hardware spec matches the CUDA device {name!r} (shipped: {available_specs()}); "
                     "pass spec= a spec name or a YAML file's path")


def auto(
    graph: Graph, ctx: PlanContext, *, spec: str | None = None, memory_limit_gb: float | None = None,
    recipes: str | None = None, max_pp: int | None = None,
) -> None:
    """Search every catalog plan's parameters with the simulator and apply the fastest that fits
    (``ctx.search`` records the ranked table; ``plan.explain()`` prints it)."""
    try:
        result = search(graph, ctx.world_size, spec=spec or machine_spec(), memory_limit_gb=memory_limit_gb, recipes=recipes, max_pp=max_pp)
    except FileNotFoundError as error:
        raise ValueError(f"auto: spec={spec!r}: {error}") from error
    winner = result.best.built
    assert winner is not None  # a candidate that fits was built
    graph.take_contents(winner.planned.copy())
    ctx.zero_stage, ctx.pipeline, ctx.search = winner.zero_stage, winner.pipeline, result
    ctx.layout = winner.layout  # the rows each rank's code reads are the winner's
