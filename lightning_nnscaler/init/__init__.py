"""Deferred, streamed initialization: build a module on the meta device, then each rank materializes only its pieces.

Usage::

    torch.manual_seed(0)
    with recording_init("cpu") as record:      # modules built here live on the meta device
        model = MyModel(config)                # its init ops are recorded; the CPU generator advances as eagerly
    weight_piece = record.materialize(model, "layer.weight", box=((0, 512), (0, 1024)))
    pieces = record.materialize_pieces(model, locations)   # PieceLocation boxes / ZeRO chunks, one storage at a time
    record.materialize_module(model)           # or: everything, in place (tests, one device)

Values equal eager construction's on the recording device under the same seed, bit for bit; see
``recorder`` for what is recorded and what is refused, and ``record`` for the replay.

Which tensors are recorded: every tensor created in the block on the default device (or with
``device="meta"``) lives on ``meta`` and is recorded, parameters and buffers alike (``torch.arange``,
``torch.ones``, ``torch.tensor([...])``, a deep copy). A tensor created with an explicit real device
stays real and is handed back as it is. Real values a recorded op reads (Python data, a CPU tensor
copied in) are copied into the record and kept while it lives, as is each random op's generator
state (5 KiB on the CPU); nothing else is held.

A block patches ``torch.Tensor.is_meta`` process-wide while it runs (see ``recorder``): run one at a
time, and build nothing on other threads meanwhile.
"""

from lightning_nnscaler.init.record import InitRecord, recording_init, tensor_at
from lightning_nnscaler.init.recorder import DeferredInitError

__all__ = ["DeferredInitError", "InitRecord", "recording_init", "tensor_at"]
