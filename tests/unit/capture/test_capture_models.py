"""Capture fidelity: interpreting a traced graph gives eager's loss and every parameter gradient."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_nnscaler as lnn
from lightning_nnscaler.models.evoformer import Evoformer, EvoformerConfig
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.models.mbart import MBart, MBartConfig
from lightning_nnscaler.models.swin import Swin, SwinConfig


class ClassifierLoss(nn.Module):
    """A third-party classifier plus cross-entropy, as a user would wrap it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(images), labels)


class LanguageModelLoss(nn.Module):
    """A Hugging Face model that computes its own loss from labels."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        if len(inputs) == 1:
            return self.model(input_ids=inputs[0], labels=inputs[0]).loss
        return self.model(input_ids=inputs[0], labels=inputs[1]).loss


def _reference(model_class: type, config: Any) -> Callable[[], tuple[nn.Module, Any, str | None]]:
    def build() -> tuple[nn.Module, Any, str | None]:
        model = model_class(config)
        return model, model.example_batch(2, torch.Generator().manual_seed(1)), "training_step"

    return build


def _hf_gpt2() -> tuple[nn.Module, Any, str | None]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False)
    return LanguageModelLoss(GPT2LMHeadModel(config)), (torch.randint(0, 128, (2, 16)),), None


def _hf_bert() -> tuple[nn.Module, Any, str | None]:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return LanguageModelLoss(BertForMaskedLM(config)), (torch.randint(0, 128, (2, 16)), torch.randint(0, 128, (2, 16))), None


def _hf_t5() -> tuple[nn.Module, Any, str | None]:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, use_cache=False)
    return LanguageModelLoss(T5ForConditionalGeneration(config)), (torch.randint(1, 128, (2, 16)), torch.randint(1, 128, (2, 8))), None


def _timm(name: str, **overrides: Any) -> Callable[[], tuple[nn.Module, Any, str | None]]:
    def build() -> tuple[nn.Module, Any, str | None]:
        import timm

        model = timm.create_model(name, pretrained=False, num_classes=10, **overrides)
        return ClassifierLoss(model), (torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))), None

    return build


MODELS = {
    "gpt": _reference(GPT, GPTConfig.small()),
    "swin": _reference(Swin, SwinConfig.small()),
    "mbart": _reference(MBart, MBartConfig.small()),
    "evoformer": _reference(Evoformer, EvoformerConfig.small()),
    "hf_gpt2": _hf_gpt2,
    "hf_bert": _hf_bert,
    "hf_t5": _hf_t5,
    "timm_swin": _timm("swin_tiny_patch4_window7_224", img_size=32, patch_size=2, window_size=4, embed_dim=16, depths=(1, 1), num_heads=(1, 2), drop_path_rate=0.0),
    "timm_vit": _timm("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2),
}


def _eager(module: nn.Module, example: Any, step: str | None) -> torch.Tensor:
    if step == "training_step":
        module.log = lambda *args, **kwargs: None  # no Trainer attached
        loss = module.training_step(example, 0)
        del module.log
        return loss
    return module(*example)


@pytest.mark.parametrize("name", list(MODELS))
def test_interpreted_graph_matches_eager(name: str) -> None:
    torch.manual_seed(0)
    module, example, step = MODELS[name]()
    module.train()
    graph = lnn.trace(module, example, step=step)

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
    module, example, step = MODELS[name]()
    graph = lnn.trace(module, example, step=step)
    text = str(graph)
    assert str(lnn.Graph.from_text(text)) == text


def test_parameters_map_to_state_dict_keys() -> None:
    module, example, step = MODELS["gpt"]()
    graph = lnn.trace(module, example, step=step)
    keys = {tensor.state_key for tensor in graph.parameters}
    assert keys == {key for key, _ in module.named_parameters()}
    assert all(tensor.requires_grad for tensor in graph.parameters)


def test_no_grad_recycling_passes_are_marked() -> None:
    module, example, step = MODELS["evoformer"]()
    graph = lnn.trace(module, example, step=step)
    no_grad_ops = [op for op in graph.ops if op.no_grad]
    assert no_grad_ops, "the first recycling passes run under torch.no_grad and must be marked"
    assert len(no_grad_ops) < len(graph.ops)
