"""Planning for ``NnScalerStrategy``: what it checks at construction and setup (the recipe and its
parameters; at setup, that they fit the devices and the model's attention heads), the plan from the
first batch, and each batch's inputs for the plan."""

from __future__ import annotations

from typing import Any, Callable

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_nnscaler.capture import flatten_inputs
from lightning_nnscaler.parallelize import Plan, parallelize
from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.plans.catalog import RecipeError, apply_recipe, load_recipe


def check_recipe(recipe: str, params: dict[str, Any]) -> None:
    """Raise unless ``recipe`` is in the catalog and ``params`` fit its parameters.

    Raises:
        RecipeError: naming the recipe or the parameter, and how to call the strategy instead.
    """
    try:
        load_recipe(recipe).check_parameters(params)
    except RecipeError as error:
        raise RecipeError(
            f"NnScalerStrategy(recipe={recipe!r}, ...): {error}. Pass a recipe of the catalog and its parameters as "
            f"keyword arguments, e.g. {_usage_example(recipe)}; `lightning_nnscaler.list_recipes()` lists them."
        ) from error


def _usage_example(recipe: str) -> str:
    """``NnScalerStrategy(recipe=..., <its parameters>)`` for an error message."""
    try:
        spec = load_recipe(recipe)
    except RecipeError:
        return "NnScalerStrategy(recipe='tp', degree=2)"
    arguments = [f"recipe={recipe!r}"] + [f"{parameter.name}=<{parameter.type}>" for parameter in spec.parameters.values()]
    return f"NnScalerStrategy({', '.join(arguments)})"


def plan_training_step(
    module: LightningModule, batch: Any, recipe: str, params: dict[str, Any], world_size: int,
    gather: Callable[[Any], list[Any]],
) -> Plan:
    """Trace ``module.training_step`` on ``batch`` and plan it with ``recipe`` for ``world_size`` ranks.

    Every rank calls this with the same batch and gets the same plan (planning is deterministic);
    ``gather`` (a collective) compares the plan hashes, so no rank runs code another did not plan.

    Raises:
        MisconfigurationException: the step cannot be traced or the recipe cannot plan it (the
            cause is chained and quoted), or the ranks planned different programs.
    """
    try:
        plan = parallelize(module, batch, recipe, world_size, step="training_step", **params)
    except Exception as error:  # noqa: BLE001 - every planning failure gets the recipe and the fix
        raise MisconfigurationException(
            f"NnScalerStrategy could not plan {type(module).__name__}.training_step with recipe {recipe!r} {params} on "
            f"{world_size} ranks: {error}\nCheck the recipe's constraints (`lightning_nnscaler.list_recipes()`), the "
            "global batch size (the DataLoader's batch_size) and `devices`."
        ) from error
    hashes = gather(plan.plan_hash)
    if len(set(hashes)) > 1:
        raise MisconfigurationException(
            f"the ranks planned different programs (plan hashes by rank: {[h[:12] for h in hashes]}); every rank must "
            "trace the same first batch: keep NnScalerStrategy's sampler (use_distributed_sampler=True) and the same "
            "data on every rank."
        )
    return plan


def check_supported(module: LightningModule, recipe: str, params: dict[str, Any], world_size: int) -> None:
    """Raise for what the strategy cannot run (at setup, before any training).

    Raises:
        MisconfigurationException: manual optimization, or a recipe whose parameters do not fit ``world_size`` or the model's attention heads (`check_fits`).
    """
    if not module.automatic_optimization:
        raise MisconfigurationException(
            f"{type(module).__name__} sets automatic_optimization = False. NnScalerStrategy runs the captured "
            "training_step (forward and backward) itself, so manual optimization is not supported: remove "
            "`self.automatic_optimization = False` and return the loss from training_step."
        )
    check_fits(module, recipe, params, world_size)


def check_fits(module: torch.nn.Module, recipe: str, params: dict[str, Any], world_size: int) -> None:
    """Raise unless the recipe's parameters fit ``world_size`` devices and its tensor-parallel pieces
    divide every attention layer's heads (the catalog's constraints that need no batch).

    The recipe checks its own parameters: it runs on an empty graph (no op to place) for ``world_size``.

    Raises:
        MisconfigurationException: naming the parameter, the device count and the fix.
    """
    spec = load_recipe(recipe)
    call = f"NnScalerStrategy({', '.join([f'recipe={recipe!r}', *(f'{key}={value!r}' for key, value in params.items())])})"
    try:
        apply_recipe(Graph(), recipe, world_size, **params)
    except ValueError as error:
        keys = ", ".join(spec.parameters) or "the recipe"
        raise MisconfigurationException(
            f"{call} does not fit the Trainer's {world_size} devices (devices × num_nodes = {world_size}): {error}. "
            f"Pass {keys} to fit {world_size} devices, or change the Trainer's devices / num_nodes. "
            f"Recipe {recipe!r} needs: {'; '.join(spec.constraints)}."
        ) from error
    pieces = head_pieces(recipe, {**{key: p.default for key, p in spec.parameters.items()}, **params}, world_size)
    if pieces is None:
        return
    count, reason = pieces
    for name, heads in attention_heads(module):
        if heads % count:
            raise MisconfigurationException(
                f"{call} cuts attention heads into {count} pieces ({reason}), but {type(module).__name__}.{name} has "
                f"{heads} heads, which {count} does not divide. Pick the recipe's parameters or the Trainer's devices so "
                f"that the pieces divide {heads} (recipe {recipe!r} needs: {'; '.join(spec.constraints)}), or use recipe='dp'."
            )


def head_pieces(recipe: str, params: dict[str, Any], world_size: int) -> tuple[int, str] | None:
    """Into how many pieces ``recipe`` cuts attention heads, and which setting decides it; None: it keeps them whole."""
    if recipe == "tp":
        degree = params["degree"]
        return (degree, f"degree={degree}") if degree else (world_size, f"degree=None: all {world_size} devices")
    if recipe == "hybrid":
        return params["tp"], f"tp={params['tp']}"
    if recipe == "coshard":
        return params["shards"] * world_size, f"shards={params['shards']} × {world_size} devices"
    if recipe == "sp":
        return world_size, f"all {world_size} devices"
    return None


def attention_heads(module: torch.nn.Module) -> list[tuple[str, int]]:
    """``(name, heads)`` of every submodule with an int ``heads`` or ``num_heads`` (``nn.MultiheadAttention``,
    the reference models' attention, most Hugging Face attention layers)."""
    found = []
    for name, submodule in module.named_modules():
        heads = getattr(submodule, "heads", getattr(submodule, "num_heads", None))
        if isinstance(heads, int) and not isinstance(heads, bool) and heads > 0:
            found.append((name, heads))
    return found


def graph_inputs(plan: Plan, batch: Any) -> dict[str, torch.Tensor]:
    """The batch's tensors by graph input name.

    Raises:
        MisconfigurationException: the batch's shapes are not the planned ones (the first batch's).
    """
    values = flatten_inputs(batch, step="training_step")
    expected = plan.graph.user_inputs
    shapes = [tuple(value.shape) for value in values]
    if shapes != [tuple(tensor.shape) for tensor in expected]:
        raise MisconfigurationException(
            f"a training batch has tensor shapes {shapes}, but the step was planned for {[tuple(t.shape) for t in expected]} "
            "(the first batch). NnScalerStrategy needs batches of one shape: set drop_last=True on the train DataLoader "
            "and pad sequences to a fixed length."
        )
    return {tensor.name: value for tensor, value in zip(expected, values)}
