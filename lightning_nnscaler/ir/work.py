"""The work of one op from its pieces' shapes: FLOPs and bytes, the one rule the stage balancer, the
simulator and ``explain`` share.

Forward work: matmul-like ops ``2·(output elements)·K`` FLOPs with ``K`` the contracted size (Kaplan et
al. 2020, §2.1: 2 FLOPs per multiply-add; for ``addmm(bias, a, b)`` K is ``a``'s last dim); attention
``4·B·H·L·S·E`` (QKᵀ and AV); convolution ``2·(output elements)·(C_in/groups·k_h·k_w)``; anything else
one FLOP per output element. Bytes are what the op reads and writes; view-like ops move nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_nnscaler.ir.op import Op
from lightning_nnscaler.ir.tensor import FLOATING

MATMULS = frozenset({"aten.linear.default", "aten.matmul.default", "aten.mm.default", "aten.bmm.default"})
ADD_MATMULS = frozenset({"aten.addmm.default", "aten.baddbmm.default"})  # (bias, a, b): K from a
ATTENTION = frozenset({"aten.scaled_dot_product_attention.default", "aten._scaled_dot_product_flash_attention_for_cpu.default"})
CONVOLUTIONS = frozenset({"aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default", "aten.convolution.default"})
VIEWS = frozenset({
    "aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.transpose.int", "aten.t.default",
    "aten.permute.default", "aten.expand.default", "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.default",
    "aten.slice.Tensor", "aten.select.int", "aten.alias.default", "aten.detach.default", "aten.unflatten.int",
    "aten.flatten.using_ints", "aten.split.Tensor", "aten.chunk.default", "aten.unbind.int", "aten.split_with_sizes.default",
})


@dataclass(frozen=True)
class OpWork:
    """Forward work of one op: FLOPs, bytes read and written, the dtype its FLOPs run in, and whether it is a matmul."""

    flops: float
    nbytes: float
    dtype: str
    matmul: bool
    has_backward: bool


def op_work(op: Op) -> OpWork:
    """The forward FLOPs and bytes of ``op`` from its pieces' shapes (see the module docstring)."""
    inputs = op.tensor_inputs
    outputs = op.outputs
    out_elements = sum(math.prod(output.shape) for output in outputs)
    dtype = outputs[0].tensor.dtype if outputs else (inputs[0].tensor.dtype if inputs else "float32")
    has_backward = not op.no_grad and any(piece.tensor.dtype in FLOATING for piece in inputs) and dtype in FLOATING
    if op.target in VIEWS:
        return OpWork(0.0, 0.0, dtype, False, has_backward)
    nbytes = float(sum(piece.nbytes for piece in (*inputs, *outputs)))
    flops, matmul = float(out_elements), False
    if op.target in MATMULS and inputs and inputs[0].shape:
        flops, matmul = 2.0 * out_elements * inputs[0].shape[-1], True
    elif op.target in ADD_MATMULS and len(inputs) >= 2 and inputs[1].shape:
        flops, matmul = 2.0 * out_elements * inputs[1].shape[-1], True
    elif op.target in ATTENTION and len(inputs) >= 3 and len(inputs[1].shape) >= 2:
        flops, matmul = 4.0 * math.prod(inputs[0].shape) * inputs[1].shape[-2], True
    elif op.target in CONVOLUTIONS and len(inputs) >= 2 and len(inputs[1].shape) >= 2:
        flops, matmul = 2.0 * out_elements * math.prod(inputs[1].shape[1:]), True
    return OpWork(flops, nbytes, dtype, matmul, has_backward)
