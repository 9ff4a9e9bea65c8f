"""The activation peak metered while a plan's generated code runs (``sim.meter``), every rank in this
process as ``Plan.verify`` runs them: what ``sim.predict`` and ``explain`` estimate."""

from __future__ import annotations

import torch

from lightning_nnscaler.codegen import module_from_source
from lightning_nnscaler.runtime.executor import RankExecutor
from lightning_nnscaler.runtime.memory_comm import run_ranks
from lightning_nnscaler.sim.meter import SavedMeter


def metered_peaks(plan) -> list[int]:
    """Per rank, the peak bytes saved for backward during one step of the plan's code (held pieces excluded)."""
    inputs = plan.inputs()
    state = {**dict(plan.module.named_parameters(remove_duplicate=False)), **dict(plan.module.named_buffers(remove_duplicate=False))}

    def run_rank(communicator) -> int:
        rank = communicator.rank
        module = module_from_source(plan.sources[rank], f"metered_rank{rank}")
        executor = RankExecutor(module, rank, state, plan.graph.constant_values, communicator, input_offsets=plan.input_offsets(rank))
        meter = SavedMeter({tensor.untyped_storage().data_ptr() for tensor in executor.held.values() if tensor.numel()})
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            executor.forward_backward(plan.replica_inputs(rank, inputs))
        return meter.peak

    return run_ranks(plan.world_size, run_rank)
