"""Runtime: what generated per-rank code calls on torch.distributed (or on in-memory virtual ranks)."""

from lightning_nnscaler.runtime import autograd_comm
from lightning_nnscaler.runtime.comm import CommunicationError, Communicator, TorchDistributedCommunicator
from lightning_nnscaler.runtime.groups import GroupCache, MissingGroupError
from lightning_nnscaler.runtime.memory_comm import InMemoryCommunicator, InMemoryWorld, run_ranks

__all__ = [
    "CommunicationError", "Communicator", "GroupCache", "InMemoryCommunicator", "InMemoryWorld", "MissingGroupError",
    "TorchDistributedCommunicator", "autograd_comm", "run_ranks",
]
