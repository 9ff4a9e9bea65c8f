"""``nn.Transformer*`` handed a mask without an ``is_causal`` hint: captured, causal when the mask is torch's own."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.modules import transformer as torch_transformer

import lightning_nnscaler as lnn
from lightning_nnscaler.capture.causal_masks import causal_masks_known

SDPA = "aten.scaled_dot_product_attention.default"


class Decoder(nn.Module):
    def __init__(self, mask_kind: str) -> None:
        super().__init__()
        layer = nn.TransformerDecoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
        self.decoder = nn.TransformerDecoder(layer, num_layers=1)
        self.mask_kind = mask_kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.size(1)
        if self.mask_kind == "generated":
            mask = nn.Transformer.generate_square_subsequent_mask(length)
        else:  # a causal mask built by hand: its values are unknown while tracing
            mask = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)
        return self.decoder(x, x, tgt_mask=mask).sum()


def _self_attention_is_causal(graph: lnn.Graph) -> bool:
    first = next(op for op in graph.ops if op.target == SDPA)
    return bool(first.args[5]) if len(first.args) > 5 else bool(first.kwargs_dict.get("is_causal", False))


@pytest.mark.parametrize(("mask_kind", "causal"), [("generated", True), ("by_hand", False)])
def test_decoder_with_a_tgt_mask_is_captured(mask_kind: str, causal: bool) -> None:
    torch.manual_seed(0)
    module, x = Decoder(mask_kind), torch.randn(2, 6, 16)
    graph = lnn.trace(module, (x,))
    assert _self_attention_is_causal(graph) is causal  # by hand: the mask is applied as attn_mask, the same attention
    plan = lnn.parallelize(module, (x,), "dp", 2)
    report = plan.verify()
    assert report.loss == pytest.approx(report.reference_loss, rel=1e-5)


def test_the_patch_lives_only_inside_the_block() -> None:
    generate, detect = torch_transformer._generate_square_subsequent_mask, torch_transformer._detect_is_causal_mask
    with pytest.raises(RuntimeError), causal_masks_known():
        assert torch_transformer._detect_is_causal_mask is not detect
        raise RuntimeError
    assert (torch_transformer._generate_square_subsequent_mask, torch_transformer._detect_is_causal_mask) == (generate, detect)
    mask = nn.Transformer.generate_square_subsequent_mask(4)
    assert torch_transformer._detect_is_causal_mask(mask, None, 4)  # eager: torch's own answer, unchanged
