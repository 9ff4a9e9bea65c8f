"""Planning for ``NnScalerStrategy``: what it checks at construction and setup (the recipe and its
parameters; at setup, that they fit the devices and the model's attention heads), a plan per batch
shape, and each batch's inputs for its plan.

Batches may change shape (a ragged last batch, sequences padded to each batch's longest): each new
shape signature (``batch_signature``) is planned anew, at most ``MAX_PLANS`` times per fit, and its
executor wraps the same parameter pieces as the first plan's (``share_pieces``), so the optimizer,
its state and the gradient buckets stay those of the first plan."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Callable
from types import ModuleType

import torch
from torch.utils import _pytree as pytree
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_nnscaler.capture import CaptureError, FrozenValueError, flatten_inputs
from lightning_nnscaler.codegen import CodegenError
from lightning_nnscaler.ir.randomness import RANDOM_LIKE_OP, RANDOM_OP
from lightning_nnscaler.ir.validate import PlanError
from lightning_nnscaler.plan import GlobalMeanWarning, Plan, parallelize, warn_means_over_kept_targets
from lightning_nnscaler.plans.catalog import RecipeError, load_recipe
from lightning_nnscaler.ir.op import Op
from lightning_nnscaler.plans.layout import RecipeLayout
from lightning_nnscaler.plans.stage_cuts import OpPrices
from lightning_nnscaler.sim.profile import measured_prices
from lightning_nnscaler.runtime.executor import RankExecutor

MAX_PLANS = 8  # distinct batch shapes per fit: each costs a trace and a plan (seconds) and a module


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
    gather: Callable[[Any], list[Any]], *, allow_partial: bool = False, batch_idx: int = 0, step: str = "training_step",
    step_args: tuple = (), bucket_bytes: int | None = None, known_prices: dict[str, float] | None = None,
) -> Plan:
    """Trace ``module.training_step`` (or the evaluation ``step``, called with ``step_args`` after ``batch_idx``) on the whole batch of ``batch``'s shapes and plan it with ``recipe``
    for ``world_size`` ranks.

    ``batch`` is this rank's data-parallel replica's batch; the step is traced on a whole batch of
    ``replicas × batch`` rows (``whole_batch``), so every rank plans the same program whatever its
    samples (planning is deterministic); ``gather`` (a collective) compares the plan hashes, so no
    rank runs code another did not plan. ``bucket_bytes``: the gradient buckets' size (the strategy's ``bucket_cap_mb``).

    Raises:
        MisconfigurationException: the step cannot be traced or the recipe cannot plan it (the
            cause is chained and quoted), or the ranks planned different programs.
    """
    replicas = load_recipe(recipe).layout(world_size, params).data_parallel
    try:
        with warnings.catch_warnings():
            if module.global_rank != 0:  # every rank plans the same program: rank 0 alone says what it notices
                warnings.simplefilter("ignore", GlobalMeanWarning)
            plan = parallelize(
                module, whole_batch(batch, replicas), recipe, world_size, step=step, batch_idx=batch_idx, step_args=step_args,
                allow_partial=allow_partial, progress=rank_zero_info, rank=module.global_rank, bucket_bytes=bucket_bytes,
                measured_prices=rank_zero_prices(module, gather, {} if known_prices is None else known_prices), **params,
            )
    except Exception as error:  # noqa: BLE001 - every planning failure gets the recipe and the fix
        hint = (
            "\nCheck the recipe's constraints (`lightning_nnscaler.list_recipes()`), the DataLoader's batch_size "
            "(per data-parallel replica) and `devices`."
        ) if breaks_recipe_constraints(error) else ""
        raise MisconfigurationException(
            f"NnScalerStrategy could not plan {type(module).__name__}.{step} with recipe {recipe!r} {params} on "
            f"{world_size} ranks: {error}{hint}"
        ) from error
    hashes = gather(plan.plan_hash)
    if len(set(hashes)) > 1:
        raise MisconfigurationException(
            f"the ranks planned different programs (plan hashes by rank: {[h[:12] for h in hashes]}); every rank must "
            "trace the same first batch: keep NnScalerStrategy's sampler (use_distributed_sampler=True) and the same "
            "data on every rank."
        )
    return plan


def rank_zero_prices(module: LightningModule, gather: Callable[[Any], list[Any]], known: dict[str, float]) -> OpPrices:
    """Op prices for ``balance="measured"``: rank 0 times the ops on its device and every rank cuts its stages by rank 0's
    times (each rank's own would differ, and so would their plans). An op named in ``known`` (what an earlier plan of the
    fit measured, by op name) keeps its price, so that a batch of other rows or an evaluation step cuts the stages where
    training did. Called by every rank alike (planning is the same on every rank); a failure on rank 0 reaches every
    rank as an error, not a hang."""
    device = str(module.device) if module.device.type == "cuda" else "cpu"

    def prices(ops: Sequence[Op]) -> list[float]:
        new = [op for op in ops if op.name not in known]
        measured, failure = None, None
        if module.global_rank == 0 and new:
            try:
                measured = list(measured_prices(device)(new))
            except Exception as error:  # noqa: BLE001 - told to every rank below
                failure = f"{type(error).__name__}: {error}"
        measured, failure = gather((measured, failure))[0]
        if failure is not None:
            raise RuntimeError(f"balance='measured': rank 0 could not time the model's ops: {failure}")
        known.update(zip((op.name for op in new), measured or (), strict=True))
        return [known[op.name] for op in ops]

    return prices


MAX_STEP_VARIANTS = 8
"""Plans per batch shape for the outcomes of a step's decisions on per-step values (``batch_idx % 100 == 0``)."""


def check_step_variants(module: LightningModule, variants: list[Plan], values: dict[str, int]) -> None:
    """Refuse to plan a step once more when it already has `MAX_STEP_VARIANTS` plans for one batch shape.

    Raises:
        FrozenValueError: naming the decisions that change, where they are made, and the fix.
    """
    if len(variants) < MAX_STEP_VARIANTS:
        return
    changed = {str(guard) for plan in variants if (guard := plan.step_values.failed_guard(values)) is not None}
    raise FrozenValueError(
        f"{type(module).__name__}.training_step decides differently on per-step values at its {MAX_STEP_VARIANTS + 1}th "
        f"outcome ({'; '.join(sorted(changed)[:3])}): each outcome is traced and planned anew. Compute such a value by "
        "arithmetic, which the plan computes at every step (`loss * (0.5 * self.global_step + 1)`, `torch.where(...)`), "
        "instead of a decision that changes every step (`int(...)`, `float(...)`, an index, a comparison), or do the Python "
        "side (printing, counters) in a hook such as on_train_batch_start."
    )


def breaks_recipe_constraints(error: Exception) -> bool:
    """Whether planning failed because the recipe, its parameters, the batch or the devices do not fit the
    model (so the recipe's constraints are the hint), not for a capture error (which says its own fix) or an
    internal failure such as code generation."""
    if isinstance(error, (CaptureError, CodegenError)):
        return False
    return isinstance(error, (RecipeError, PlanError)) or type(error) is ValueError


def check_supported(
    module: LightningModule, recipe: str, params: dict[str, Any], world_size: int, *, allow_partial: bool = False
) -> RecipeLayout:
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
    return check_fits(module, recipe, params, world_size, allow_partial=allow_partial)


def check_fits(
    module: torch.nn.Module, recipe: str, params: dict[str, Any], world_size: int, *, allow_partial: bool = False
) -> RecipeLayout:
    """Raise unless the recipe's parameters fit ``world_size`` devices and its tensor-parallel pieces
    divide every attention layer's heads (the catalog's constraints that need no batch); with
    ``allow_partial`` heads may stay whole (planning then warns how much of the model was split).

    Returns:
        The recipe's layout for ``world_size`` ranks (data-parallel replicas, head pieces).

    Raises:
        MisconfigurationException: naming the parameter, the device count and the fix.
    """
    spec = load_recipe(recipe)
    call = f"NnScalerStrategy({', '.join([f'recipe={recipe!r}', *(f'{key}={value!r}' for key, value in params.items())])})"
    try:
        layout = spec.layout(world_size, params)
    except ValueError as error:
        keys = ", ".join(spec.parameters) or "the recipe"
        raise MisconfigurationException(
            f"{call} does not fit the Trainer's {world_size} devices (devices × num_nodes = {world_size}): {error}. "
            f"Pass {keys} to fit {world_size} devices, or change the Trainer's devices / num_nodes. "
            f"Recipe {recipe!r} needs: {'; '.join(spec.constraints)}."
        ) from error
    if layout.head_pieces is None or allow_partial:
        return layout
    for name, heads in attention_heads(module):
        if heads % layout.head_pieces:
            raise MisconfigurationException(
                f"{call} cuts attention heads into {layout.head_pieces} pieces ({layout.head_reason}), but "
                f"{type(module).__name__}.{name} has {heads} heads, which {layout.head_pieces} does not divide. Pick the "
                f"recipe's parameters or the Trainer's devices so that the pieces divide {heads} (recipe {recipe!r} needs: "
                f"{'; '.join(spec.constraints)}), or use recipe='dp', or pass allow_partial=True to keep those heads whole."
            )
    return layout


def attention_heads(module: torch.nn.Module) -> list[tuple[str, int]]:
    """``(name, heads)`` of every submodule with an int ``heads`` or ``num_heads`` (``nn.MultiheadAttention``,
    the reference models' attention, most Hugging Face attention layers)."""
    found = []
    for name, submodule in module.named_modules():
        heads = getattr(submodule, "heads", getattr(submodule, "num_heads", None))
        if isinstance(heads, int) and not isinstance(heads, bool) and heads > 0:
            found.append((name, heads))
    return found


def whole_batch(batch: Any, replicas: int) -> Any:
    """A batch of ``replicas`` times ``batch``'s rows (its tensors repeated along dim 0): the shapes
    of the batch all data-parallel replicas load together, which the step is planned for."""
    if replicas == 1:
        return batch
    return pytree.tree_map(lambda leaf: torch.cat([leaf] * replicas) if isinstance(leaf, torch.Tensor) and leaf.dim() else leaf, batch)


def batch_signature(batch: Any) -> tuple[tuple[int, ...], ...]:
    """The shapes of the batch's tensors (this replica's), in the traced step's input order: one plan each."""
    return tuple(tuple(value.shape) for value in flatten_inputs(batch, step="training_step"))


def check_new_signature(signature: tuple, known: list[tuple], gather: Callable[[Any], list[Any]]) -> None:
    """Raise unless every rank got a batch of ``signature`` (a collective: every rank calls it when a
    shape new to it arrives) and fewer than ``MAX_PLANS`` shapes were planned before.

    With Lightning's DistributedSampler (``drop_last=False`` pads by repeating samples) every replica
    gets as many samples, so the ranks' batches have one shape at each step, the ragged last one too.

    Raises:
        MisconfigurationException: naming the ranks' shapes, or the shapes planned so far, and the fix.
    """
    by_rank = gather(signature)
    if any(other != by_rank[0] for other in by_rank):
        raise MisconfigurationException(
            f"the ranks got training batches of different shapes at the same step (by rank: {by_rank}). NnScalerStrategy plans "
            "each step for one batch shape on all data-parallel replicas: keep its DistributedSampler "
            "(use_distributed_sampler=True) and pad variable-length inputs to a length every rank uses at that step "
            "(e.g. a fixed length, or the longest of the global batch)."
        )
    if len(known) >= MAX_PLANS:
        raise MisconfigurationException(
            f"a training batch has tensor shapes {list(signature)}, a new shape after {len(known)} planned ones "
            f"({[list(shape) for shape in known]}); NnScalerStrategy plans at most {MAX_PLANS} batch shapes per fit. "
            "Pad variable-length inputs to a few fixed lengths (buckets), or set drop_last=True on the train DataLoader."
        )


def share_pieces(first: RankExecutor, code: ModuleType, plan: Plan, rank: int) -> RankExecutor:
    """An executor of ``code`` (``plan``'s module for ``rank``, planned for another batch shape) over
    ``first``'s parameter and buffer pieces, reducer and communicator (``RankExecutor.sharing_pieces``),
    so the optimizer (moved onto ``first``'s pieces) trains them whatever the plan of the step.

    Raises:
        MisconfigurationException: the plan's parameter layout differs from the first plan's.
    """
    try:
        return first.sharing_pieces(code, plan.graph.constant_values, plan.input_offsets(rank))
    except ValueError as error:
        raise MisconfigurationException(
            f"the plan for a batch of another shape cannot share the first plan's parameter pieces: {error}. The recipe's "
            "parameter layout depends on the batch shape: set drop_last=True on the train DataLoader and pad inputs to one length."
        ) from error


def graph_inputs(plan: Plan, batch: Any, loading: RecipeLayout) -> dict[str, torch.Tensor]:
    """This rank's batch tensors by graph input name, as the ``loading`` layout (the DataLoader's) gives them.

    Raises:
        MisconfigurationException: the batch's shapes are not the plan's (a bug: each shape has its plan).
    """
    values = flatten_inputs(batch, step="training_step")
    replicas = loading.data_parallel
    expected = [tuple(tensor.shape) for tensor in plan.graph.user_inputs]
    local = [(shape[0] // replicas, *shape[1:]) if shape else shape for shape in expected]
    shapes = [tuple(value.shape) for value in values]
    if shapes != local:
        raise MisconfigurationException(
            f"a training batch has tensor shapes {shapes}, but its plan is for {local} per data-parallel replica"
        )
    return {tensor.name: value for tensor, value in zip(plan.graph.user_inputs, values)}


def reads_other_rows(loading: RecipeLayout, reading: RecipeLayout, world_size: int) -> bool:
    """Whether some rank's code reads rows another rank loaded: the plan's layout (``reading``, for ``auto``
    its winner's) groups the ranks into replicas otherwise than the DataLoader's (``loading``)."""
    return loading.data_parallel != reading.data_parallel or any(
        loading.replica(rank) != reading.replica(rank) for rank in range(world_size)
    )


def gather_replica_batch(
    inputs: dict[str, torch.Tensor], loading: RecipeLayout, reading: RecipeLayout, rank: int,
    all_gather: Callable[[torch.Tensor], list[torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s rows under the ``reading`` layout, from every rank's ``inputs`` loaded under ``loading``
    (a collective: every rank calls it at every step).

    The whole batch is the loading replicas' rows in replica order, as the step was planned
    (``whole_batch``); ``all_gather(tensor)`` returns every rank's tensor, in rank order. Inputs
    without a batch dim (0-d) are the same on every rank and kept.
    """
    first_rank_of = {}
    for other in range(loading.grid.size):
        first_rank_of.setdefault(loading.replica(other), other)
    replica, replicas = reading.replica(rank), reading.data_parallel
    gathered = {}
    for name, value in inputs.items():
        if value.dim() == 0:
            gathered[name] = value
            continue
        by_rank = all_gather(value.contiguous())
        whole = torch.cat([by_rank[first_rank_of[index]] for index in range(loading.data_parallel)])
        rows = whole.shape[0] // replicas
        gathered[name] = whole[replica * rows : (replica + 1) * rows]
    return gathered


class KeptTargetsCheck:
    """Whether the data-parallel replicas keep as many targets of each loss that averages over its kept
    targets (``Plan.kept_targets``): ddp's average of the replicas' means is then the plan's global mean.

    Checked at each plan's first step (a collective when the plan has such a loss), on the batches
    the replicas really loaded; planning cannot tell, as it traces every replica's rows alike
    (``whole_batch``). Rank 0 warns (``GlobalMeanWarning``) the first time the counts differ; then
    nothing is checked any more.
    """

    def __init__(self) -> None:
        self.checked: set[str] = set()
        """Hashes of the plans checked."""
        self.warned = False

    def __call__(self, plan: Plan, inputs: dict[str, torch.Tensor], rank: int, gather: Callable[[Any], list[Any]]) -> None:
        """Check ``plan`` on this rank's batch ``inputs`` (by graph input name, as its replica loaded them) unless it was."""
        kept = plan.kept_targets
        if self.warned or plan.plan_hash in self.checked or kept is None or not kept.masks:
            return
        self.checked.add(plan.plan_hash)
        # The shapes the plan was traced on (``whole_batch``): every replica's block holds this rank's rows.
        repeated = {name: torch.cat([value] * kept.replicas) if value.dim() else value for name, value in inputs.items()}
        mine = {loss: by_replica[0] for loss, by_replica in kept.per_replica(repeated).items() if by_replica is not None}
        by_rank = gather(mine)  # the ranks of one replica loaded the same rows: comparing the ranks compares the replicas
        counts = {loss: [rank_counts[loss] for rank_counts in by_rank] for loss in mine}
        differ = any(len(set(each)) > 1 for each in counts.values())  # the same on every rank: all stop checking together
        if differ and rank == 0:
            warn_means_over_kept_targets(counts, kept.replicas)
        self.warned = differ


def random_masks_notice(plan: Plan) -> str | None:
    """What a user switching from ddp must know when the step draws random masks (dropout, stochastic depth);
    None when it draws none."""
    drawing = sorted({op.origin or op.name for op in plan.graph.ops if op.target in (RANDOM_OP, RANDOM_LIKE_OP)})
    if not drawing:
        return None
    shown = ", ".join(drawing[:3]) + (f" and {len(drawing) - 3} more" if len(drawing) > 3 else "")
    return (f"NnScalerStrategy: the step draws random masks ({shown}) from lightning-nnscaler's own generator: "
            "every plan draws the same masks for a seed and step, but not the ones torch's generator gives "
            "strategy='ddp' or one device, so losses match those runs only in distribution")
