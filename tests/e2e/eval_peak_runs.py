"""Peak resident memory per phase of a run under NnScalerStrategy, in one process group per rank (``runtime.launch``).

``peak_worker`` builds a GPT whose parameters and AdamW state dominate its memory (on meta, under
``trainer.init_module()``, or eagerly), fits it a few steps, then runs ``validate``, ``test`` and ``predict``.
A thread samples the process's resident memory (``/proc/self/statm``) every millisecond and keeps the highest
sample per phase: ``train`` (the fit's first to last step, planning included), ``end`` (from after the last
step until ``fit`` returns: the trained weights left in the module, the teardown), and each loop.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import threading
import time
from typing import Iterator, Optional

import torch

import lightning_nnscaler as lnn  # noqa: F401 - registers the strategies

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from feature_runs import EvaluatedGPT  # noqa: E402
from lightning_runs import replica_batch_size  # noqa: E402
from lightning_nnscaler.models.gpt import GPTConfig  # noqa: E402

CONFIG = GPTConfig(vocab_size=1024, seq_len=64, hidden=512, layers=4, heads=8)
"""13.7M parameters: 55 MB of weights, 220 MB of fp32 AdamW training state on one device; a batch's logits 1 MB."""
GLOBAL_BATCH, STEPS = 4, 3
PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    """This process's resident memory now."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE


class PhasePeaks:
    """The highest resident memory sampled in each phase, by a thread that samples every ``interval`` seconds."""

    def __init__(self, interval: float = 1e-3) -> None:
        self.interval = interval
        self.phase: Optional[str] = None
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            phase = self.phase
            if phase is not None:
                self.peaks[phase] = max(self.peaks.get(phase, 0), resident_bytes())
            time.sleep(self.interval)

    def enter(self, phase: Optional[str]) -> None:
        """Count the samples from now on to ``phase`` (None: to none); a sample is taken at the switch."""
        if self.phase is not None:
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), resident_bytes())
        self.phase = phase

    @contextlib.contextmanager
    def measuring(self, phase: str) -> Iterator[None]:
        """Inside: samples count to ``phase``."""
        self.enter(phase)
        try:
            yield
        finally:
            self.enter(None)

    def stop(self) -> dict[str, int]:
        """Stop sampling; the peaks by phase."""
        self._stop.set()
        self._thread.join()
        return dict(self.peaks)


class TrainingPhases(Callback):
    """Switches the sampler to ``train`` at the first training batch and to ``end`` after the last step."""

    def __init__(self, peaks: PhasePeaks) -> None:
        self.peaks = peaks

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.peaks.enter("train")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:  # before the strategy's own
        self.peaks.enter("end")


def loader(strategy: str, devices: int, seed: int) -> DataLoader:
    """``STEPS`` global batches of ``CONFIG`` tokens, each replica's share per batch."""
    tokens = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH * STEPS, CONFIG.seq_len + 1), generator=torch.Generator().manual_seed(seed))
    data = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    return DataLoader(data, batch_size=replica_batch_size(strategy, devices, GLOBAL_BATCH))


def map_large_allocations_alone() -> None:
    """glibc: give every allocation of 64 KiB or more a mapping of its own, returned to the system when freed. By default
    the threshold rises to 32 MiB as large blocks are freed, after which freed tensors stay resident and a phase's
    peak would say more about the heap's history than about the tensors it holds."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD


def peak_worker(rank: int, world_size: int, runs: list[tuple[str, str, str]]) -> dict[str, dict[str, int]]:
    """Each ``(name, strategy, init)`` run's peaks by phase on this rank."""
    torch.set_num_threads(1)  # the ranks share the cores
    map_large_allocations_alone()
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    return {name: peak_run(strategy, init, world_size) for name, strategy, init in runs}


def peak_run(strategy: str, init: str, devices: int) -> dict[str, int]:
    """Fit, validate, test and predict; the peak resident memory of each phase (bytes)."""
    gc.collect()  # what an earlier run in this process left
    peaks = PhasePeaks()
    peaks.peaks["start"] = resident_bytes()  # before the model exists
    options = dict(accelerator="cpu", devices=devices, logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer = L.Trainer(
        strategy=strategy, max_steps=STEPS, num_sanity_val_steps=0, enable_checkpointing=False, callbacks=[TrainingPhases(peaks)], **options
    )
    torch.manual_seed(0)
    with trainer.init_module(empty_init=init == "meta"):
        model = EvaluatedGPT(CONFIG)
    trainer.fit(model, loader(strategy, devices, seed=1))
    peaks.enter(None)
    for loop in ("validate", "test", "predict"):
        with peaks.measuring(loop):
            getattr(trainer, loop)(model, loader(strategy, devices, seed=2), **({} if loop == "predict" else {"verbose": False}))
    return peaks.stop()
