"""What each in-memory rank of a plan holds and sends over one training step (the runtime's real tensors).

``one_step`` runs a plan's ranks as threads with the executor and reducer the strategy uses, one training step and
Adam's step, and reports per rank the bytes of what it then holds, of what it held while the gradients were summed,
and of what it sent (by the ring convention of ``lightning_nnscaler.explain``).
"""

from __future__ import annotations

from typing import Any

import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.codegen import module_from_source
from lightning_nnscaler.runtime.executor import RankExecutor
from lightning_nnscaler.runtime.memory_comm import InMemoryCommunicator, run_ranks


class CountingCommunicator:
    """An in-memory communicator that adds up the bytes this rank sends, by the ring formulas."""

    def __init__(self, inner: InMemoryCommunicator) -> None:
        self.inner = inner
        self.sent = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _count(self, factor: int, tensor: torch.Tensor, ranks: tuple[int, ...]) -> None:
        self.sent += factor * (len(ranks) - 1) * tensor.numel() * tensor.element_size() // len(ranks)

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self.sent += tensor.numel() * tensor.element_size()
        self.inner.send(tensor, dst, tag)

    def all_reduce(self, tensor: torch.Tensor, ranks: tuple[int, ...]) -> torch.Tensor:
        self._count(2, tensor, ranks)
        return self.inner.all_reduce(tensor, ranks)

    def all_reduce_async(self, tensor: torch.Tensor, ranks: tuple[int, ...], *, in_place: bool = False) -> Any:
        self._count(2, tensor, ranks)
        return self.inner.all_reduce_async(tensor, ranks, in_place=in_place)

    def all_gather(self, tensor: torch.Tensor, dim: int, ranks: tuple[int, ...]) -> torch.Tensor:
        self._count(1, tensor.new_empty(tensor.numel() * len(ranks)), ranks)  # n is the gathered output
        return self.inner.all_gather(tensor, dim, ranks)

    def reduce_scatter(self, tensor: torch.Tensor, dim: int, ranks: tuple[int, ...]) -> torch.Tensor:
        self._count(1, tensor, ranks)
        return self.inner.reduce_scatter(tensor, dim, ranks)

    def all_to_all(self, tensor: torch.Tensor, split_dim: int, concat_dim: int, ranks: tuple[int, ...]) -> torch.Tensor:
        self._count(1, tensor, ranks)
        return self.inner.all_to_all(tensor, split_dim, concat_dim, ranks)


def storage_bytes(tensors: Any) -> int:
    """Bytes the tensors' storage holds (a ZeRO-3 box freed between steps keeps its shape over an empty storage)."""
    return sum(min(tensor.numel() * tensor.element_size(), tensor.untyped_storage().nbytes()) for tensor in tensors if tensor is not None)


def one_step(plan: lnn.Plan) -> list[dict[str, int]]:
    """Per rank, after one training step and Adam's step: the bytes it holds (``parameters``: boxes and owned chunks;
    ``gradients``; ``optimizer``: Adam's moments), the most held while its gradients were summed (``transient``:
    ZeRO-3's gathered boxes and the full gradients; ``gathered``: those boxes alone) and the bytes it sent
    (``communication``)."""
    inputs = plan.inputs()
    state = {**dict(plan.module.named_parameters(remove_duplicate=False)), **dict(plan.module.named_buffers(remove_duplicate=False))}

    def run_rank(inner: InMemoryCommunicator) -> dict[str, int]:
        rank, communicator = inner.rank, CountingCommunicator(inner)
        module = module_from_source(plan.sources[rank], f"explain_rank{rank}")
        executor = RankExecutor(module, rank, state, plan.graph.constant_values, communicator, input_offsets=plan.input_offsets(rank))
        reducer = executor.reducer
        boxes = [shard.tensor for shard in executor.shards.values() if isinstance(shard.tensor, torch.nn.Parameter)]
        chunks = [owned.chunk for owned in reducer.owned]
        in_step: dict[str, int] = {}
        reduce_scatter = reducer._reduce_scatter

        def counted_reduce_scatter(bucket: Any) -> None:  # the full-size tensors ZeRO holds only while the step runs
            owned = [owned.box for owned in reducer.owned]
            gathered = storage_bytes(owned) if reducer.zero_stage == 3 else 0  # zero1 holds its boxes across steps
            in_step["gathered"] = max(in_step.get("gathered", 0), gathered)
            in_step["transient"] = max(in_step.get("transient", 0), gathered + storage_bytes(box.grad for box in owned))
            reduce_scatter(bucket)

        reducer._reduce_scatter = counted_reduce_scatter  # type: ignore[method-assign]
        optimizer = torch.optim.Adam(executor.parameters())
        executor.forward_backward(plan.replica_inputs(rank, inputs))
        optimizer.step()
        executor.after_optimizer_step()
        buckets = [bucket.buffer for bucket in reducer._buckets]
        bucketed = {id(parameter) for bucket in reducer._buckets for parameter in bucket.parameters}
        own_gradients = [box.grad for box in boxes if id(box) not in bucketed]
        moments = [value for entry in optimizer.state.values() for key, value in entry.items() if key != "step"]
        return {
            "parameters": storage_bytes(boxes) + storage_bytes(chunks),
            "gradients": storage_bytes(buckets) + storage_bytes(own_gradients) + storage_bytes(chunk.grad for chunk in chunks),
            "optimizer": storage_bytes(moments),
            "transient": in_step.get("transient", 0),
            "gathered": in_step.get("gathered", 0),
            "communication": communicator.sent,
        }

    return run_ranks(plan.world_size, run_rank, timeout=120.0)


