"""The Lightning strategy: ``NnScalerStrategy`` (``nnscaler.py``) and its helpers, one concern a module:
``planning`` (recipe checks, the plan from the first batch, each batch's inputs), ``gradients``
(optimizer groups on the pieces, accumulation, clipping), ``checkpoint`` (sharded save and load)
and ``plan_logging`` (the plan for the loggers)."""

from lightning_nnscaler.strategy.nnscaler import NnScalerStrategy

__all__ = ["NnScalerStrategy"]
