"""Reference LightningModules used to exercise plans: GPT, Swin, mBART, Evoformer.

Each model has a keyword-only frozen config with `small()` (tests) and `paper()` (simulation
only) presets, and `example_batch(batch_size, generator)` returning a tuple of tensors that
`training_step(batch, batch_idx)` accepts. The models contain no parallelism.
"""

from lightning_nnscaler.models.evoformer import Evoformer, EvoformerConfig
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.models.mbart import MBart, MBartConfig
from lightning_nnscaler.models.swin import Swin, SwinConfig

__all__ = ["GPT", "Evoformer", "EvoformerConfig", "GPTConfig", "MBart", "MBartConfig", "Swin", "SwinConfig"]
