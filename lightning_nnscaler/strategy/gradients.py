"""What ``NnScalerStrategy`` does with a rank's parameter pieces: optimizer groups, accumulation, clipping.

A rank's optimizer updates the pieces its ``RankExecutor`` holds: parameter boxes, or under ZeRO
the flat chunks it owns of replicated boxes. These helpers know which state_dict key each piece
belongs to and how many ranks hold the same box, so that

- the user's ``configure_optimizers`` param groups (built over the full LightningModule) can be
  moved onto the pieces, key by key, keeping every group's hyperparameters and its LR schedulers
  (and state restored from a checkpoint, cut to the pieces);
- the gradients a ``forward_backward`` computes reach Lightning's ``backward`` (past its
  ``zero_grad``) and accumulate over the batches of an accumulation window;
- the global gradient norm counts each box once, however many ranks hold a replica of it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule
from torch import nn

from lightning_nnscaler.ir.box import PieceLocation, full_box
from lightning_nnscaler.runtime.executor import RankExecutor


def piece_locations(executor: RankExecutor) -> dict[int, PieceLocation]:
    """Where each piece the optimizer updates lies, by ``id(piece)``."""
    return {id(piece.tensor): piece.location for piece in executor.pieces()}


def replica_counts(executor: RankExecutor) -> dict[int, int]:
    """How many ranks hold (and, after backward, share the summed gradient of) each replicated piece, by ``id(piece)``."""
    return {id(piece.tensor): piece.replicas for piece in executor.pieces() if piece.replicas > 1}


def gradient_holders(executor: RankExecutor) -> list[torch.Tensor]:
    """Every tensor whose ``.grad`` a step writes: parameter boxes and (under ZeRO) owned chunks."""
    holders = {id(shard.tensor): shard.tensor for shard in executor.shards.values() if isinstance(shard.tensor, nn.Parameter)}
    holders.update({id(piece): piece for piece in executor.parameters()})
    return list(holders.values())


def move_param_groups(optimizer: torch.optim.Optimizer, module: nn.Module, executor: RankExecutor) -> list[list[str]]:
    """Make ``optimizer`` (built by ``configure_optimizers`` over ``module``) update ``executor``'s pieces.

    Each group keeps its dict (so its hyperparameters and any LR scheduler attached to the
    optimizer stay as they are); only ``group["params"]`` is replaced by the pieces of the same
    state_dict keys. Parameters the user left out of every group stay untrained, as before. State
    the optimizer already has (restored from a checkpoint) is cut into the pieces' state.

    Returns:
        The state_dict keys of each group's full parameters, in the group's order.

    Raises:
        ValueError: a group holds a tensor that is not a parameter of ``module``.
    """
    keys_by_parameter: dict[int, list[str]] = defaultdict(list)
    for key, parameter in module.named_parameters(remove_duplicate=False):
        keys_by_parameter[id(parameter)].append(key)
    locations = piece_locations(executor)
    pieces_by_key: dict[str, list[torch.Tensor]] = defaultdict(list)
    for piece in executor.parameters():
        pieces_by_key[locations[id(piece)].state_key].append(piece)
    group_keys, state = [], {}
    for index, group in enumerate(optimizer.param_groups):
        keys, pieces = [], []
        for parameter in group["params"]:
            if id(parameter) not in keys_by_parameter:
                raise ValueError(
                    f"param group {index} of {type(optimizer).__name__} holds a tensor of shape {tuple(parameter.shape)} that is "
                    f"not a parameter of {type(module).__name__}; configure_optimizers must optimize the module's own parameters"
                )
            keys.append(keys_by_parameter[id(parameter)][0])
            for key in keys_by_parameter[id(parameter)]:
                for piece in pieces_by_key.pop(key, []):
                    pieces.append(piece)
                    if parameter in optimizer.state:
                        state[piece] = _cut_state(optimizer.state[parameter], parameter.shape, locations[id(piece)])
        group_keys.append(keys)
        group["params"] = pieces
    optimizer.state = defaultdict(dict, state)
    return group_keys


def _cut_state(full_state: dict[str, Any], shape: torch.Size, location: PieceLocation) -> dict[str, Any]:
    """A piece's optimizer state from the whole parameter's: elementwise tensors are cut, the rest copied."""
    return {
        name: location.take(value) if isinstance(value, torch.Tensor) and value.dim() and value.shape == shape
        else (value.clone() if isinstance(value, torch.Tensor) else value)
        for name, value in full_state.items()
    }


class GradientStash:
    """Moves one step's gradients from ``training_step`` (where the executor computes them) to
    ``backward`` (where Lightning expects them), past Lightning's ``zero_grad`` in between.

    Lightning's closure runs ``training_step``, then ``zero_grad`` (on the first batch of an
    accumulation window), then ``backward``. The executor's step already ran backward, so on the
    first batch of a window ``run_step`` runs it with no ``.grad`` held and keeps the new gradients
    aside for ``apply``, which adds them to what ``zero_grad`` left. The earlier gradients are
    dropped before the step, as ``zero_grad`` would drop them, so no second copy of the gradients
    is ever alive; only when a hook reads them before ``zero_grad`` (``zero_grad_observers``) are
    they kept, as copies (a reducer's bucket, which they may be views of, is overwritten by the
    step), and put back for that hook and ``zero_grad``. On the other batches of a window no
    ``zero_grad`` comes, so the step accumulates into ``.grad`` directly and ``apply`` has nothing to
    do. Adding to a kept gradient makes a new tensor (the kept one may be a bucket, which a later
    step reuses).
    """

    def __init__(self, holders: Iterable[torch.Tensor], *, keep_earlier: bool = False) -> None:
        self.holders = list(holders)
        self.keep_earlier = keep_earlier
        self.pending: dict[int, torch.Tensor] = {}

    def run_step(self, step: Callable[[], torch.Tensor], *, zero_grad_follows: bool) -> torch.Tensor:
        """Run ``step``; if Lightning's ``zero_grad`` follows it, with no gradient held, keeping what it computes for ``apply``."""
        if not zero_grad_follows:
            return step()
        earlier = {id(holder): holder.grad.clone() for holder in self.holders if holder.grad is not None} if self.keep_earlier else {}
        for holder in self.holders:
            holder.grad = None
        result = step()
        self.pending = {id(holder): holder.grad for holder in self.holders if holder.grad is not None}
        for holder in self.holders:
            holder.grad = earlier.get(id(holder))
        return result

    def apply(self) -> None:
        """Add the kept gradients to what the holders hold now."""
        for holder in self.holders:
            new = self.pending.get(id(holder))
            if new is not None:
                holder.grad = new if holder.grad is None else holder.grad + new
        self.pending = {}


def zero_grad_observers(module: LightningModule, callbacks: Iterable[Callback]) -> list[str]:
    """The hooks that may read the previous step's gradients before Lightning's ``zero_grad`` (empty: none)."""
    found = [
        f"{type(module).__name__}.{hook}" for hook in ("on_before_zero_grad", "optimizer_zero_grad")
        if getattr(type(module), hook) is not getattr(LightningModule, hook)
    ]
    return found + [
        f"{type(callback).__name__}.on_before_zero_grad" for callback in callbacks
        if getattr(type(callback), "on_before_zero_grad", None) is not Callback.on_before_zero_grad
    ]


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float, replicas: dict[int, int], all_reduce: Any) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` (2-norm) over the pieces of every rank.

    Args:
        parameters: This rank's pieces that the optimizer updates.
        max_norm: The largest global norm allowed.
        replicas: ``replica_counts``: a box held by ``n`` ranks adds ``1/n`` of its squared norm on
            each, so that it counts once.
        all_reduce: Sums a scalar tensor over the world.

    Returns:
        The global norm before clipping (what single-device ``clip_grad_norm_`` returns).
    """
    with_grad = [parameter for parameter in parameters if parameter.grad is not None]
    device = with_grad[0].grad.device if with_grad else torch.device("cpu")
    local = torch.zeros((), dtype=torch.float64, device=device)
    for parameter in with_grad:
        local += parameter.grad.detach().double().pow(2).sum() / replicas.get(id(parameter), 1)
    total = all_reduce(local).sqrt().float()
    # torch.nn.utils.clip_grad_norm_'s rule: multiply by min(1, max_norm / (norm + 1e-6)).
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for parameter in with_grad:
        parameter.grad.detach().mul_(coefficient.to(parameter.grad.dtype))
    return total


def broadcast_buffers(executor: RankExecutor, plan: Any, world_size: int) -> None:
    """Give every rank rank 0's copy of each buffer the step writes, as ddp does before each forward that
    syncs gradients (``broadcast_buffers=True``, its default, which Lightning keeps): each rank then
    updates it from its own rows. Only buffers every rank holds whole are broadcast (a collective), and
    which those are is read from the plan, the same on every rank: a pipeline's stages hold different
    BatchNorms, and a rank deciding from its own pieces would call broadcasts its peers never match."""
    shapes = {plan.graph.tensors[name].state_key: plan.graph.tensors[name].shape for name in plan.graph.buffer_updates}
    if world_size == 1 or not shapes:
        return
    holders: dict[str, set[int]] = defaultdict(set)
    for op in plan.planned.ops:
        for piece in op.tensor_inputs:
            key = piece.tensor.state_key
            if piece.tensor.role == "buffer" and key in shapes and tuple(piece.index.ranges) == full_box(shapes[key]):
                holders[key].add(op.device)
    everywhere = {key for key, ranks in holders.items() if len(ranks) == world_size}
    whole = {
        shard.location.state_key: shard for shard in executor.shards.values()
        if shard.location.state_key in everywhere and shard.location.chunk is None and shard.location.box == full_box(shapes[shard.location.state_key])
    }
    for key in sorted(everywhere):
        dist.broadcast(whole[key].tensor.data, src=0)
