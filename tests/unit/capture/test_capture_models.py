"""Capture fidelity: interpreting a traced graph gives eager's loss and every parameter gradient.

The models are those of ``tests/support/op_cases.py`` (the four reference models, Hugging Face GPT-2,
BERT, T5, timm Swin and ViT), traced once per process there and shared with the annotation and split
tests (tracing is the slow part: seconds per model). Each test builds its own module the same way,
from the same seed, so its weights and batch are those the graph was traced from.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from support.op_cases import MODELS, SEED, traced

import lightning_nnscaler as lnn


def built_and_traced(name: str) -> tuple[nn.Module, Any, str | None, lnn.Graph]:
    """A fresh module of ``MODELS[name]`` (training mode), its example, its step, and its (shared) traced graph."""
    graph, _ = traced(name)
    torch.manual_seed(SEED)  # as op_cases.traced built the module it traced
    module, example, step = MODELS[name]()
    module.train()
    return module, example, step, graph


def _eager(module: nn.Module, example: Any, step: str | None) -> torch.Tensor:
    if step == "training_step":
        module.log = lambda *args, **kwargs: None  # no Trainer attached
        loss = module.training_step(example, 0)
        del module.log
        return loss
    return module(*example)


@pytest.mark.parametrize("name", list(MODELS))
def test_interpreted_graph_matches_eager(name: str) -> None:
    module, example, step, graph = built_and_traced(name)

    eager_loss = _eager(module, example, step)
    eager_loss.backward()
    eager_grads = {key: p.grad.clone() for key, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)

    outputs = lnn.run_graph(graph, lnn.bind_inputs(graph, module, example, step=step))
    loss = outputs[graph.outputs[0]]
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    loss.backward()
    graph_grads = {key: p.grad for key, p in module.named_parameters() if p.grad is not None}
    assert graph_grads.keys() == eager_grads.keys()
    assert len(graph_grads) == sum(1 for p in module.parameters() if p.requires_grad) or name == "evoformer"
    for key, grad in eager_grads.items():
        torch.testing.assert_close(graph_grads[key], grad, rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{name} grad {key}: {m}")


@pytest.mark.parametrize("name", ["gpt", "hf_gpt2"])
def test_text_form_parses_back(name: str) -> None:
    graph, _ = traced(name)
    text = str(graph)
    assert str(lnn.Graph.from_text(text)) == text


def test_parameters_map_to_state_dict_keys() -> None:
    module, _, _, graph = built_and_traced("gpt")
    keys = {tensor.state_key for tensor in graph.parameters}
    assert keys == {key for key, _ in module.named_parameters()}
    assert all(tensor.requires_grad for tensor in graph.parameters)


def test_no_grad_recycling_passes_are_marked() -> None:
    graph, _ = traced("evoformer")
    no_grad_ops = [op for op in graph.ops if op.no_grad]
    assert no_grad_ops, "the first recycling passes run under torch.no_grad and must be marked"
    assert len(no_grad_ops) < len(graph.ops)
