"""Planning for ``NnScalerStrategy``: what it checks at construction and setup, the plan from the
first batch, and each batch's inputs for the plan."""

from __future__ import annotations

from typing import Any, Callable

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_nnscaler.capture import flatten_inputs
from lightning_nnscaler.parallelize import Plan, parallelize
from lightning_nnscaler.plans.catalog import RecipeError, load_recipe


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


def check_supported(module: LightningModule, precision_plugin: Precision, precision: str) -> None:
    """Raise for what the strategy cannot run (at setup, before any training).

    Raises:
        MisconfigurationException: manual optimization, or a precision that needs a loss scaler.
    """
    if not module.automatic_optimization:
        raise MisconfigurationException(
            f"{type(module).__name__} sets automatic_optimization = False. NnScalerStrategy runs the captured "
            "training_step (forward and backward) itself, so manual optimization is not supported: remove "
            "`self.automatic_optimization = False` and return the loss from training_step."
        )
    if getattr(precision_plugin, "scaler", None) is not None:
        raise MisconfigurationException(
            f"precision={precision!r} needs a loss scaler, which the generated step does not apply yet; "
            "use precision='bf16-mixed' or '32-true' with NnScalerStrategy."
        )


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
