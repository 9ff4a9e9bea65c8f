"""Building blocks shared by the reference models (no parallelism here, by design)."""

from __future__ import annotations

import ast
import inspect
import textwrap

import torch.nn.functional as F
from torch import Tensor, nn


def field_docs(config_class: type) -> dict[str, str]:
    """Return each dataclass field's attribute docstring (the string literal under the field).

    Python keeps no runtime record of attribute docstrings, so they are read from the
    class source. Used by tests and by anything that documents config keys (CLI, recipes).

    Args:
        config_class: a dataclass whose fields are each followed by a docstring.

    Returns:
        Field name -> docstring, for the fields that have one.
    """
    tree = ast.parse(textwrap.dedent(inspect.getsource(config_class)))
    body = tree.body[0].body  # the ClassDef's statements
    docs: dict[str, str] = {}
    for statement, following in zip(body[:-1], body[1:], strict=True):
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[statement.target.id] = inspect.cleandoc(following.value.value)
    return docs


class MultiHeadAttention(nn.Module):
    """Multi-head attention with separate q/k/v projections (self- or cross-attention).

    Separate projections (rather than one fused qkv Linear) keep each weight a plain
    (out, in) matrix whose output dim splits cleanly by head.
    """

    def __init__(self, hidden: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if hidden % heads != 0:
            raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads}).")
        self.heads = heads
        self.head_dim = hidden // heads
        self.dropout = dropout
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: Tensor, context: Tensor | None = None, is_causal: bool = False) -> Tensor:
        """Attend from `x` (B, T, C) to `context` (B, S, C), or to `x` itself when None."""
        context = x if context is None else context
        B, T, C = x.shape
        S = context.shape[1]
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(context).view(B, S, self.heads, self.head_dim).transpose(1, 2)  # (B, nh, S, hs)
        v = self.v_proj(context).view(B, S, self.heads, self.head_dim).transpose(1, 2)  # (B, nh, S, hs)
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return self.out_proj(y)


class MLP(nn.Module):
    """Transformer feed-forward: Linear -> GELU -> Linear -> Dropout."""

    def __init__(self, hidden: int, ffn_hidden: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn_hidden)
        self.fc2 = nn.Linear(ffn_hidden, hidden)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        """(..., hidden) -> (..., hidden)."""
        return self.dropout(self.fc2(F.gelu(self.fc1(x))))


def init_transformer_weights(module: nn.Module, std: float = 0.02) -> None:
    """GPT-2 style init, for `model.apply`: N(0, std) weights, zero biases, unit LayerNorms."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)
