"""Gradient reduction for parameter boxes held by several ranks: buckets, ZeRO stage 1 and 3.

A box held by ranks ``g`` (data-parallel replicas, or replicas a plan made) gets the sum of their
gradients. Stage 0 all-reduces gradients in flat buckets. ZeRO splits each box's flattened
elements into ``len(g)`` equal chunks (the last padded): rank ``g[i]`` owns chunk ``i``.
Stage 1: gradients are reduce-scattered onto the chunks, the optimizer updates only its chunk
(so its state is 1/len(g) of the box), and the chunks are all-gathered back into the box.
Stage 3: the box itself is freed between steps; it is all-gathered from the chunks before the
forward pass, so parameters, gradients and optimizer state at rest are all 1/len(g).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

BUCKET_BYTES = 25 * 1024 * 1024  # the bucket size DDP defaults to


@dataclass
class _Owned:
    """This rank's chunk of a replicated box."""

    box: torch.nn.Parameter
    ranks: tuple[int, ...]
    chunk: torch.nn.Parameter
    numel: int
    shape: torch.Size


class GradientReducer:
    """Sums replicated gradients after backward; with ZeRO, owns the optimizer's chunks."""

    def __init__(self, replicated: list[tuple[torch.nn.Parameter, tuple[int, ...]]], communicator: Any, rank: int, zero_stage: int = 0) -> None:
        if zero_stage not in (0, 1, 3):
            raise ValueError(f"zero_stage must be 0, 1 or 3, got {zero_stage!r}")
        self.communicator = communicator
        self.zero_stage = zero_stage
        self.replicated = replicated
        self.owned: list[_Owned] = []
        if zero_stage:
            for box, ranks in replicated:
                self.owned.append(self._own(box, ranks, rank))
            if zero_stage == 3:
                self.release_boxes()

    def _own(self, box: torch.nn.Parameter, ranks: tuple[int, ...], rank: int) -> _Owned:
        numel = box.numel()
        size = math.ceil(numel / len(ranks))
        flat = torch.nn.functional.pad(box.detach().reshape(-1), (0, size * len(ranks) - numel))
        index = ranks.index(rank)
        chunk = torch.nn.Parameter(flat[index * size : (index + 1) * size].clone())
        return _Owned(box, ranks, chunk, numel, box.shape)

    def optimizer_parameters(self, parameters: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
        """What the optimizer should update: owned chunks instead of replicated boxes under ZeRO."""
        if not self.zero_stage:
            return parameters
        replaced = {id(owned.box) for owned in self.owned}
        return [parameter for parameter in parameters if id(parameter) not in replaced] + [owned.chunk for owned in self.owned]

    def before_forward(self) -> None:
        """ZeRO-3: gather every box from its chunks."""
        if self.zero_stage == 3:
            self.gather_boxes()

    def after_backward(self) -> None:
        """Sum the replicated gradients (buckets), or reduce-scatter them onto the owned chunks."""
        if not self.zero_stage:
            self._all_reduce_in_buckets()
            return
        for owned in self.owned:
            grad = owned.box.grad if owned.box.grad is not None else torch.zeros(owned.shape, dtype=owned.box.dtype, device=owned.box.device)
            flat = torch.nn.functional.pad(grad.reshape(-1), (0, owned.chunk.numel() * len(owned.ranks) - owned.numel))
            owned.chunk.grad = self.communicator.reduce_scatter(flat, 0, owned.ranks)
            owned.box.grad = None

    def after_optimizer_step(self) -> None:
        """ZeRO-1: gather the updated chunks into the boxes; ZeRO-3: keep only the chunks."""
        if self.zero_stage == 1:
            self.gather_boxes()
        elif self.zero_stage == 3:
            self.release_boxes()

    def gather_boxes(self) -> None:
        """Rebuild every replicated box from the owned chunks of its ranks."""
        for owned in self.owned:
            flat = self.communicator.all_gather(owned.chunk.detach(), 0, owned.ranks)
            owned.box.data = flat[: owned.numel].reshape(owned.shape).clone()

    def gathered_gradients(self) -> dict[int, torch.Tensor]:
        """ZeRO: each replicated box's summed gradient, gathered from the chunks (by ``id(box)``)."""
        gradients = {}
        for owned in self.owned:
            grad = owned.chunk.grad if owned.chunk.grad is not None else torch.zeros_like(owned.chunk)
            gradients[id(owned.box)] = self.communicator.all_gather(grad.detach(), 0, owned.ranks)[: owned.numel].reshape(owned.shape)
        return gradients

    def release_boxes(self) -> None:
        """Free the replicated boxes' storage (ZeRO-3 at rest)."""
        for owned in self.owned:
            owned.box.data = torch.empty(0, dtype=owned.box.dtype, device=owned.box.device)
            owned.box.grad = None

    def _all_reduce_in_buckets(self) -> None:
        by_group: dict[tuple[int, ...], list[torch.nn.Parameter]] = {}
        for parameter, ranks in self.replicated:
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            by_group.setdefault(ranks, []).append(parameter)
        for ranks, parameters in by_group.items():
            bucket: list[torch.nn.Parameter] = []
            size = 0
            for parameter in parameters:
                bucket.append(parameter)
                size += parameter.grad.numel() * parameter.grad.element_size()
                if size >= BUCKET_BYTES:
                    self._all_reduce(bucket, ranks)
                    bucket, size = [], 0
            if bucket:
                self._all_reduce(bucket, ranks)

    def _all_reduce(self, bucket: list[torch.nn.Parameter], ranks: tuple[int, ...]) -> None:
        flat = torch.cat([parameter.grad.reshape(-1) for parameter in bucket])
        summed = self.communicator.all_reduce(flat, ranks)
        offset = 0
        for parameter in bucket:
            count = parameter.grad.numel()
            parameter.grad.copy_(summed[offset : offset + count].view_as(parameter.grad))
            offset += count
