"""The three primitives every plan is made of, and the constraints that bound them."""

from lightning_nnscaler.primitives.assign import AssignError, op_assign
from lightning_nnscaler.primitives.constraints import ConstraintError, Constraints
from lightning_nnscaler.primitives.order import op_order, op_orders
from lightning_nnscaler.primitives.trans import TransformError, op_trans

__all__ = ["AssignError", "ConstraintError", "Constraints", "TransformError", "op_assign", "op_order", "op_orders", "op_trans"]
