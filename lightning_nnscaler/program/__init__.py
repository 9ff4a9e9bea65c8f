"""The step as one program (DESIGN.md §9): ``Action``s per rank, their buckets, and the passes that lower a schedule to it.

Nothing here imports torch; the runtime, the simulator and the validator all read the same ``Program``.
"""

from lightning_nnscaler.program.actions import Action, ActionKind
from lightning_nnscaler.program.buckets import BUCKET_BYTES, Bucket, ReplicatedBox, gradient_buckets
from lightning_nnscaler.program.lower import (
    WHOLE_STEP_ACTIONS, SegmentPeers, compute_only, last_accumulating, lower_step, with_loss, with_messages, with_optimizer, with_reductions,
)
from lightning_nnscaler.program.program import Program

__all__ = [
    "WHOLE_STEP_ACTIONS", "Action", "ActionKind", "BUCKET_BYTES", "Bucket", "Program", "ReplicatedBox", "SegmentPeers", "compute_only", "gradient_buckets",
    "last_accumulating", "lower_step", "with_loss", "with_messages", "with_optimizer", "with_reductions",
]
