"""lightning-nnscaler: parallelization plans composed from op-trans, op-assign and op-order.

``import lightning_nnscaler`` is cheap: it imports neither torch nor Lightning, so that the command
line (``lightning-nnscaler --help``, ``lightning-nnscaler recipes``) starts at once. What it sets up:

* every public name (``__all__``) is imported from its module on first use (PEP 562 ``__getattr__``);
  ``parallelize`` and ``Plan`` live in ``lightning_nnscaler.plan`` (no submodule shares a public name);
* the strategies (``Trainer(strategy="nnscaler")``, ``"nnscaler_tp"``, ...) are registered with
  Lightning's ``StrategyRegistry`` as soon as ``lightning.pytorch`` has been imported, or at once when it
  already was. ``lightning_nnscaler.strategy`` registers them when it is imported; this package imports
  it after ``lightning.pytorch``, or, when one of its own modules imported Lightning, once that
  module's import has finished (the strategy imports it).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_nnscaler._import_hooks import call_after_import

if TYPE_CHECKING:
    from lightning_nnscaler import checkpoint
    from lightning_nnscaler.capture import CaptureError, FrozenValueError, bind_inputs, flatten_inputs, register_annotation, trace
    from lightning_nnscaler.ir.annotation import DimAnnotation
    from lightning_nnscaler.ir.errors import NnScalerError
    from lightning_nnscaler.ir.graph import Graph
    from lightning_nnscaler.ir.interpret import run_graph
    from lightning_nnscaler.ir.op import Op
    from lightning_nnscaler.ir.tensor import IndexMask, PTensor, ValueMask, VTensor
    from lightning_nnscaler.ir.validate import IdleRankError, PlanError, validate_plan
    from lightning_nnscaler.plan import GlobalMeanWarning, Plan, build_plan, parallelize
    from lightning_nnscaler.plans.catalog import RecipeError, apply_recipe, list_recipes, load_recipe, register_recipe
    from lightning_nnscaler.plans.context import PlanContext
    from lightning_nnscaler.plans.coverage import PartialPlanWarning
    from lightning_nnscaler.plans.layout import DeviceGrid, RecipeLayout
    from lightning_nnscaler.primitives import Constraints, op_assign, op_order, op_trans
    from lightning_nnscaler.strategy import NnScalerStrategy
    from lightning_nnscaler.verify import assert_equivalent

_MODULE_OF: dict[str, str] = {
    "NnScalerStrategy": "lightning_nnscaler.strategy",
    "checkpoint": "lightning_nnscaler.checkpoint",  # the subpackage itself: load, merge, open_merged
    **dict.fromkeys(["CaptureError", "FrozenValueError", "bind_inputs", "flatten_inputs", "register_annotation", "trace"], "lightning_nnscaler.capture"),
    "DimAnnotation": "lightning_nnscaler.ir.annotation",
    "NnScalerError": "lightning_nnscaler.ir.errors",
    "Graph": "lightning_nnscaler.ir.graph",
    "run_graph": "lightning_nnscaler.ir.interpret",
    "Op": "lightning_nnscaler.ir.op",
    **dict.fromkeys(["IndexMask", "PTensor", "ValueMask", "VTensor"], "lightning_nnscaler.ir.tensor"),
    **dict.fromkeys(["IdleRankError", "PlanError", "validate_plan"], "lightning_nnscaler.ir.validate"),
    **dict.fromkeys(["GlobalMeanWarning", "Plan", "build_plan", "parallelize"], "lightning_nnscaler.plan"),
    **dict.fromkeys(["RecipeError", "apply_recipe", "list_recipes", "load_recipe", "register_recipe"], "lightning_nnscaler.plans.catalog"),
    **dict.fromkeys(["DeviceGrid", "RecipeLayout"], "lightning_nnscaler.plans.layout"),
    "PlanContext": "lightning_nnscaler.plans.context",
    "PartialPlanWarning": "lightning_nnscaler.plans.coverage",
    **dict.fromkeys(["Constraints", "op_assign", "op_order", "op_trans"], "lightning_nnscaler.primitives"),
    "assert_equivalent": "lightning_nnscaler.verify",
}

__all__ = [
    "NnScalerStrategy", "checkpoint",
    "CaptureError", "Constraints", "FrozenValueError", "IdleRankError", "NnScalerError", "PartialPlanWarning", "PlanError", "DimAnnotation", "Graph", "IndexMask", "Op", "PTensor", "ValueMask", "VTensor",
    "assert_equivalent", "bind_inputs", "flatten_inputs", "op_assign", "op_order", "op_trans", "register_annotation", "run_graph",
    "DeviceGrid", "GlobalMeanWarning", "Plan", "PlanContext", "RecipeError", "RecipeLayout", "apply_recipe", "build_plan", "list_recipes", "load_recipe", "parallelize", "register_recipe", "trace", "validate_plan",
]


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use (then kept as a plain attribute)."""
    module_name = _MODULE_OF.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = module if module_name == f"{__name__}.{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def _register_strategies_with_lightning() -> None:
    importlib.import_module("lightning_nnscaler.strategy")  # registers the strategies as it is imported


call_after_import("lightning.pytorch", _register_strategies_with_lightning, outside_of=__name__)
