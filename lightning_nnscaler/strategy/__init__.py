"""The Lightning strategy: ``NnScalerStrategy`` (``nnscaler.py``) and its helpers, one concern a module:
``planning`` (recipe checks, the plan from the first batch, each batch's inputs), ``gradients``
(optimizer groups on the pieces, accumulation, clipping), ``checkpoint`` (sharded save and load)
and ``plan_logging`` (the plan for the loggers).

Importing this package registers the strategies with Lightning's ``StrategyRegistry``
(``Trainer(strategy="nnscaler")``, ``"nnscaler_tp"``, ...); ``import lightning_nnscaler`` imports it
once ``lightning.pytorch`` is imported."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_nnscaler.strategy.nnscaler import NnScalerStrategy

if "nnscaler" not in StrategyRegistry:
    NnScalerStrategy.register_strategies(StrategyRegistry)

__all__ = ["NnScalerStrategy"]
