"""Autograd-aware communication, chained by a token so that backward replays it in reverse order.

Why a token. Each rank's backward must issue its communications in exactly the reverse of its
forward order: then the backward program of every rank is the forward program transposed (a send
becomes a recv, a recv a send, a collective its adjoint collective), and reversing every edge of a
deadlock-free happens-before graph gives a deadlock-free graph. Autograd alone does not guarantee
that order: it runs any node whose gradients are ready, and it skips a ``send`` entirely (a send
has no output that reaches the loss), which would leave the peer waiting for a gradient forever.

So every function here takes ``token`` and returns a new one. The token is a 0-d float tensor that
requires grad; each communication is one ``autograd.Function`` whose outputs include the new token
and whose inputs include the old one. That makes the communications of a rank a chain in the
autograd graph: node k's backward produces the gradient of token k-1, which node k-1 needs before
it may run, so the nodes run strictly in reverse. Backward must start from the *last* token (see
``backward``), which also makes every node of the chain reachable, sends included. The token holds
no information: its gradient is always zero.

Gradient semantics: every consumer's contribution is summed.

====================  ==================================================================
forward               backward (on the gradient of the output)
====================  ==================================================================
send(x → dst)         blocking recv of x's gradient from dst
recv(y ← src)         asynchronous send of y's gradient to src
all_reduce            all_reduce
all_gather(dim)       reduce_scatter(dim)
reduce_scatter(dim)   all_gather(dim)
all_to_all(s, c)      all_to_all(c, s): split and concat dims swapped
broadcast(src)        sum to src (an all_reduce; src keeps it, the others get no gradient)
====================  ==================================================================

Backward p2p messages use ``tag + BACKWARD_TAG_OFFSET`` so they never match forward ones.
Whether a tensor carries a gradient is decided by its dtype alone (floating point or complex),
never by ``requires_grad``: every rank of a collective, and both ends of a message, must agree on
whether the backward communication happens, and the dtype is the one thing they all know. Integer
and bool tensors (indices, masks) pass through without gradients or backward communication. A
floating tensor that does not require grad still takes part in the backward communication; its
gradient is dropped.

Backward sends are asynchronous: call ``comm.wait_sends()`` after backward, as after forward.
"""

from __future__ import annotations

from functools import partial
from typing import Sequence

import torch

from lightning_nnscaler.runtime.comm import Communicator

BACKWARD_TAG_OFFSET = 1 << 20  # forward tags stay below it; a backward message uses tag + this


def new_token(device: torch.device | str | None = None) -> torch.Tensor:
    """A fresh token: the start of a rank's communication chain for one forward/backward."""
    return torch.zeros((), device=device, requires_grad=True)


def backward(
    token: torch.Tensor, tensors: Sequence[torch.Tensor] = (), grad_tensors: Sequence[torch.Tensor | None] | None = None
) -> None:
    """Backward from ``tensors`` (weighted by ``grad_tensors``) that also runs this rank's whole communication chain.

    Differentiates ``0 * token + sum((tensor * grad).sum())``: the same gradients as
    ``torch.autograd.backward(tensors, grad_tensors)`` (the seed of each element is exactly its grad),
    plus the token as a root. Seeding a scalar implicitly also avoids torch's explicit-gradient check,
    whose first call imports sympy (seconds, once per process).

    Args:
        token: the last token this rank's forward returned.
        tensors: this rank's outputs to differentiate (e.g. its loss); empty on a rank without one.
        grad_tensors: their gradients; ``None`` (the default, or per tensor) means a gradient of ones.
    """
    grads = list(grad_tensors) if grad_tensors is not None else [None] * len(tensors)
    root = token * 0
    for tensor, grad in zip(tensors, grads, strict=True):
        root = root + (tensor.sum() if grad is None else (tensor * grad).sum())
    root.backward()


def _differentiable(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


class _Send(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token, tensor, dst, tag, comm):
        comm.send(tensor, dst, tag)
        ctx.comm, ctx.dst, ctx.tag = comm, dst, tag
        ctx.shape, ctx.dtype = tuple(tensor.shape), tensor.dtype
        return token.clone()

    @staticmethod
    def backward(ctx, grad_token):
        grad = None
        if _differentiable(ctx.dtype):
            grad = ctx.comm.recv(ctx.shape, ctx.dtype, ctx.dst, ctx.tag + BACKWARD_TAG_OFFSET)
        return grad_token, grad, None, None, None


class _Recv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token, shape, dtype, src, tag, comm):
        received = comm.recv(shape, dtype, src, tag)
        ctx.comm, ctx.src, ctx.tag, ctx.dtype = comm, src, tag, dtype
        if not _differentiable(dtype):
            ctx.mark_non_differentiable(received)
        return received, token.clone()

    @staticmethod
    def backward(ctx, grad, grad_token):
        if _differentiable(ctx.dtype):
            ctx.comm.send(grad, ctx.src, ctx.tag + BACKWARD_TAG_OFFSET)
        return grad_token, None, None, None, None, None


class _Collective(torch.autograd.Function):
    """``forward_op(tensor)`` forward, ``backward_op(grad)`` backward; both run on every rank of the group."""

    @staticmethod
    def forward(ctx, token, tensor, forward_op, backward_op):
        result = forward_op(tensor)
        ctx.backward_op = backward_op if _differentiable(result.dtype) else None
        if ctx.backward_op is None:
            ctx.mark_non_differentiable(result)
        return result, token.clone()

    @staticmethod
    def backward(ctx, grad, grad_token):
        grad_input = ctx.backward_op(grad) if ctx.backward_op is not None else None
        return grad_token, grad_input, None, None


def send(token: torch.Tensor, tensor: torch.Tensor, dst: int, tag: int, comm: Communicator) -> torch.Tensor:
    """Send ``tensor`` to ``dst`` (asynchronous); backward receives its gradient from ``dst``. Returns the new token."""
    return _Send.apply(token, tensor, dst, tag, comm)


def recv(
    token: torch.Tensor, shape: Sequence[int], dtype: torch.dtype, src: int, tag: int, comm: Communicator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Receive from ``src`` (blocking); backward sends the gradient back. Returns ``(tensor, token)``."""
    return _Recv.apply(token, tuple(shape), dtype, src, tag, comm)


def all_reduce(
    token: torch.Tensor, tensor: torch.Tensor, ranks: tuple[int, ...], comm: Communicator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over ``ranks``; backward all-reduces the gradient. Returns ``(sum, token)``."""
    return _Collective.apply(token, tensor, partial(comm.all_reduce, ranks=ranks), partial(comm.all_reduce, ranks=ranks))


def all_gather(
    token: torch.Tensor, tensor: torch.Tensor, dim: int, ranks: tuple[int, ...], comm: Communicator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate along ``dim`` in ``ranks`` order; backward reduce-scatters the gradient. Returns ``(tensor, token)``."""
    return _Collective.apply(
        token, tensor, partial(comm.all_gather, dim=dim, ranks=ranks), partial(comm.reduce_scatter, dim=dim, ranks=ranks)
    )


def reduce_scatter(
    token: torch.Tensor, tensor: torch.Tensor, dim: int, ranks: tuple[int, ...], comm: Communicator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum, keep this rank's chunk along ``dim``; backward all-gathers the gradient. Returns ``(chunk, token)``."""
    return _Collective.apply(
        token, tensor, partial(comm.reduce_scatter, dim=dim, ranks=ranks), partial(comm.all_gather, dim=dim, ranks=ranks)
    )


def all_to_all(
    token: torch.Tensor, tensor: torch.Tensor, split_dim: int, concat_dim: int, ranks: tuple[int, ...], comm: Communicator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split along ``split_dim``, exchange, concatenate along ``concat_dim``; backward swaps the dims."""
    forward_op = partial(comm.all_to_all, split_dim=split_dim, concat_dim=concat_dim, ranks=ranks)
    backward_op = partial(comm.all_to_all, split_dim=concat_dim, concat_dim=split_dim, ranks=ranks)
    return _Collective.apply(token, tensor, forward_op, backward_op)


def broadcast(
    token: torch.Tensor,
    tensor: torch.Tensor | None,
    src: int,
    ranks: tuple[int, ...],
    shape: Sequence[int],
    dtype: torch.dtype,
    comm: Communicator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``src``'s tensor on every rank (the others pass ``None``); backward sums the gradients into ``src``."""

    def sum_to_source(grad: torch.Tensor) -> torch.Tensor | None:
        total = comm.all_reduce(grad, ranks)
        return total if comm.rank == src else None

    forward_op = partial(comm.broadcast, src=src, ranks=ranks, shape=tuple(shape), dtype=dtype)
    return _Collective.apply(token, tensor, forward_op, sum_to_source)
