"""lightning-nnscaler: parallelization plans composed from op-trans, op-assign and op-order."""

from lightning_nnscaler._compat import declare_torchvision_ops_when_its_kernels_cannot_load

declare_torchvision_ops_when_its_kernels_cannot_load()

# isort: split

from lightning_nnscaler.capture import CaptureError, FrozenValueError, bind_inputs, flatten_inputs, register_annotation, trace
from lightning_nnscaler.ir.annotation import DimAnnotation
from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir.interpret import run_graph
from lightning_nnscaler.ir.op import Op
from lightning_nnscaler.ir.tensor import IndexMask, PTensor, ValueMask, VTensor
from lightning_nnscaler.ir.validate import IdleRankError, PlanError, validate_plan
from lightning_nnscaler.parallelize import Plan, build_plan, parallelize
from lightning_nnscaler.plans.catalog import RecipeError, apply_recipe, list_recipes, load_recipe, register_recipe
from lightning_nnscaler.plans.layout import DeviceGrid, RecipeLayout
from lightning_nnscaler.plans.context import PlanContext
from lightning_nnscaler.plans.coverage import PartialPlanWarning
from lightning_nnscaler.primitives import Constraints, op_assign, op_order, op_trans
from lightning_nnscaler.verify import assert_equivalent

# isort: split

from lightning.pytorch.strategies import StrategyRegistry as _StrategyRegistry  # noqa: E402 - after the torchvision fix

from lightning_nnscaler import checkpoint  # noqa: E402 - sharded checkpoints: load, merge, open_merged
from lightning_nnscaler.strategy import NnScalerStrategy  # noqa: E402

NnScalerStrategy.register_strategies(_StrategyRegistry)  # Trainer(strategy="nnscaler"), "nnscaler_tp", ...

__all__ = [
    "NnScalerStrategy", "checkpoint",
    "CaptureError", "Constraints", "FrozenValueError", "IdleRankError", "PartialPlanWarning", "PlanError", "DimAnnotation", "Graph", "IndexMask", "Op", "PTensor", "ValueMask", "VTensor",
    "assert_equivalent", "bind_inputs", "flatten_inputs", "op_assign", "op_order", "op_trans", "register_annotation", "run_graph",
    "DeviceGrid", "Plan", "PlanContext", "RecipeError", "RecipeLayout", "apply_recipe", "build_plan", "list_recipes", "load_recipe", "parallelize", "register_recipe", "trace", "validate_plan",
]
