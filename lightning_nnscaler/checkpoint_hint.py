"""A sharded checkpoint given to another strategy is refused with the ``ckpt merge`` command.

A lightning-nnscaler checkpoint is a directory; ``Trainer(strategy="auto").fit(model, ckpt_path=DIR)``
would fail in ``torch.load`` with a bare ``IsADirectoryError``. The install registers `hint_callbacks`
under Lightning's ``lightning.pytorch.callbacks_factory`` entry point, so every Trainer gets a
`ShardedCheckpointHint`: in ``setup`` (before Lightning restores the checkpoint) it raises, naming the
path and the merge command, when ``ckpt_path`` is such a directory and the strategy is not ours. It
does nothing else.

Lightning sets ``trainer.ckpt_path`` only as it restores, after ``setup``; until then the path is the
``ckpt_path`` argument of the ``Trainer._run`` call in progress, which `_pending_ckpt_path` reads from
that call's frame (where a Lightning version lays this out otherwise, the hint is simply not given).
"""

from __future__ import annotations

import sys
from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_nnscaler.checkpoint.integrity import CheckpointError
from lightning_nnscaler.checkpoint.layout import POINTER, merge_hint


class ShardedCheckpointHint(Callback):
    """Refuses a lightning-nnscaler sharded checkpoint under a strategy that cannot read it."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        path = _pending_ckpt_path(trainer) or trainer.ckpt_path
        if not path or type(trainer.strategy).__module__.startswith("lightning_nnscaler."):
            return
        if Path(path).is_dir() and (Path(path) / POINTER).is_file():
            raise CheckpointError(f"strategy {type(trainer.strategy).__name__} cannot load ckpt_path: {merge_hint(path)}")


def _pending_ckpt_path(trainer: Trainer) -> str | None:
    """The ``ckpt_path`` of the ``trainer._run`` call that is running this hook, if any."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is Trainer._run.__code__ and frame.f_locals.get("self") is trainer:
            path = frame.f_locals.get("ckpt_path")
            return str(path) if path else None
        frame = frame.f_back
    return None


def hint_callbacks() -> list[Callback]:
    """Lightning's ``callbacks_factory`` entry point: one `ShardedCheckpointHint` per Trainer."""
    return [ShardedCheckpointHint()]
