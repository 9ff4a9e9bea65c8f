"""runtime.split_backward: I (input gradients) then W (weight gradients) run each backward op once, and equal one backward.

The op counts come from a TorchDispatchMode over the aten ops each pass runs, on two GPT blocks; the
reference is a plain ``backward()`` of the same model from the same root.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from lightning_nnscaler.models.gpt import Block, GPTConfig
from lightning_nnscaler.runtime.split_backward import input_gradients

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_thread")]

INPUT_ONLY_OPS = {"_scaled_dot_product_flash_attention_for_cpu_backward", "gelu_backward", "transpose", "add", "mul", "pow"}
"""Ops of two GPT blocks' backward that only the input half runs (attention, activation, residual and loss arithmetic)."""


class OpCounter(TorchDispatchMode):
    """Counts the aten ops run under it by name, and keeps the output masks of layer-norm backwards."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.layer_norm_masks: list[tuple[bool, ...]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func.overloadpacket.__name__
        self.counts[name] += 1
        if name == "native_layer_norm_backward":
            self.layer_norm_masks.append(tuple(args[-1]))
        return func(*args, **(kwargs or {}))


def blocks() -> torch.nn.Module:
    """Two GPT blocks with seed-0 weights."""
    torch.manual_seed(0)
    config = GPTConfig.small()
    return torch.nn.Sequential(Block(config), Block(config))


def root_of(model: torch.nn.Module, head: Callable[[torch.Tensor], torch.Tensor] = lambda y: (y**2).sum()) -> tuple[torch.Tensor, torch.Tensor]:
    """A boundary input (a leaf that requires grad) and the scalar root of ``model`` on it."""
    generator = torch.Generator().manual_seed(1)
    leaf = torch.randn(4, 16, GPTConfig.small().hidden, generator=generator).requires_grad_()
    return leaf, head(model(leaf))


def reference(model: torch.nn.Module) -> tuple[torch.Tensor, list[torch.Tensor], Counter[str], float]:
    """One plain backward: the input gradient, the parameter gradients, the ops run and their flops."""
    leaf, root = root_of(model)
    with OpCounter() as ops, FlopCounterMode(display=False) as flops:
        root.backward()
    return leaf.grad, [parameter.grad for parameter in model.parameters()], ops.counts, flops.get_total_flops()


def test_i_and_w_run_the_ops_of_one_backward_and_w_no_input_gradient_op() -> None:
    expected_input, expected_parameters, backward_ops, backward_flops = reference(blocks())
    model = blocks()
    leaf, root = root_of(model)
    with OpCounter() as i_ops, FlopCounterMode(display=False) as i_flops:
        (input_gradient,), weight_pass = input_gradients(root, [leaf], list(model.parameters()))
    assert all(parameter.grad is None for parameter in model.parameters())
    with OpCounter() as w_ops, FlopCounterMode(display=False) as w_flops:
        weight_pass.accumulate()

    assert i_flops.get_total_flops() + w_flops.get_total_flops() == backward_flops
    assert w_ops.counts["mm"] == 12 and i_ops.counts["mm"] + w_ops.counts["mm"] == backward_ops["mm"]  # 6 linears a block
    assert not INPUT_ONLY_OPS & set(w_ops.counts) and INPUT_ONLY_OPS <= set(backward_ops)
    assert all(not mask[0] for mask in w_ops.layer_norm_masks) and all(mask == (True, False, False) for mask in i_ops.layer_norm_masks)
    both = i_ops.counts + w_ops.counts
    both["native_layer_norm_backward"] -= len(w_ops.layer_norm_masks)  # one kernel, called once per half
    assert {name: count for name, count in both.items() if name != "detach"} == {name: count for name, count in backward_ops.items() if name != "detach"}
    torch.testing.assert_close(input_gradient, expected_input, rtol=0, atol=0)
    for parameter, expected in zip(model.parameters(), expected_parameters, strict=True):
        torch.testing.assert_close(parameter.grad, expected, rtol=1e-6, atol=1e-7)


def test_w_accumulates_each_parameter_once_through_its_accumulator() -> None:
    """The reducer's post-accumulate-grad hooks fire once per parameter in W, never in I; ``.grad`` adds up as in torch."""
    model = blocks()
    fired: Counter[int] = Counter()
    for parameter in model.parameters():
        parameter.register_post_accumulate_grad_hook(lambda tensor: fired.update([id(tensor)]))
    leaf, root = root_of(model)
    _, weight_pass = input_gradients(root, [leaf], list(model.parameters()))
    assert not fired
    weight_pass.accumulate()
    assert fired == Counter(id(parameter) for parameter in model.parameters())
    first = [parameter.grad.clone() for parameter in model.parameters()]
    leaf, root = root_of(model)
    input_gradients(root, [leaf], list(model.parameters()))[1].accumulate()
    for parameter, once in zip(model.parameters(), first, strict=True):
        torch.testing.assert_close(parameter.grad, 2 * once)


def test_a_weight_used_twice_along_the_input_path_gets_its_gradient_once() -> None:
    """y = lin(gelu(lin(x))): both linears' nodes are junctions of one group, one reaching the other."""
    def run(split: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        linear = torch.nn.Linear(8, 8)
        leaf = torch.randn(3, 8, generator=torch.Generator().manual_seed(2)).requires_grad_()
        root = (linear(torch.nn.functional.gelu(linear(leaf))) ** 2).sum()
        if split:
            (gradient,), weight_pass = input_gradients(root, [leaf], list(linear.parameters()))
            assert [len(group.junctions) for group in weight_pass.groups] == [2]
            weight_pass.accumulate()
        else:
            root.backward()
            gradient = leaf.grad
        return gradient, linear.weight.grad, linear.bias.grad

    for split, plain in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(split, plain)


def test_without_input_gradients_w_is_the_whole_backward() -> None:
    """A first stage (no boundary input needs a gradient), or inputs the root never reaches: I does nothing."""
    _, expected_parameters, _, _ = reference(blocks())
    for leaves in ([], [torch.zeros(3, requires_grad=True)]):
        model = blocks()
        _, root = root_of(model)
        with OpCounter() as i_ops:
            gradients, weight_pass = input_gradients(root, leaves, list(model.parameters()))
        assert gradients == tuple(None for _ in leaves) and not i_ops.counts
        weight_pass.accumulate()
        for parameter, expected in zip(model.parameters(), expected_parameters, strict=True):
            torch.testing.assert_close(parameter.grad, expected, rtol=1e-6, atol=1e-7)


def test_a_checkpointed_segment_splits_into_the_same_gradients() -> None:
    """Recomputed stages: W's autograd calls recompute the checkpointed forward and still give one backward's gradients."""
    def run(split: bool) -> list[torch.Tensor]:
        model = blocks()
        leaf, root = root_of(model, head=lambda y: (y**2).sum())
        leaf = leaf.detach().requires_grad_()
        root = (torch.utils.checkpoint.checkpoint(model, leaf, use_reentrant=False) ** 2).sum()
        if split:
            (gradient,), weight_pass = input_gradients(root, [leaf], list(model.parameters()))
            weight_pass.accumulate()
        else:
            root.backward()
            gradient = leaf.grad
        return [gradient, *(parameter.grad for parameter in model.parameters())]

    for split, plain in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(split, plain, rtol=1e-6, atol=1e-7)
