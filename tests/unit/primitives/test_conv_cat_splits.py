"""Splits of the ops that user models bring to pipelines: every conv (depthwise, grouped, plain) splits by batch,
a depthwise one by channels too; Hugging Face's empty key/value cache is dropped from its cat at capture
(``capture.empty_caches``), and a cat that still skips one splits by batch."""

from __future__ import annotations

import pytest
import torch
from support.op_cases import OpCase, _recorded, check_split, single_threaded
from torch import nn

import lightning_nnscaler as lnn
from lightning_nnscaler.ir.op import Op
from lightning_nnscaler.ir.rules import annotate_op
from lightning_nnscaler.ir.tensor import PTensor


class ConvsAndCaches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.depthwise = nn.Conv2d(8, 8, 3, padding=1, groups=8)  # ConvNeXt, MobileNet
        self.grouped = nn.Conv2d(8, 4, 3, padding=1, groups=2, bias=False)
        self.plain = nn.Conv1d(4, 4, 3, padding=1)

    def forward(self, images: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        features = self.grouped(self.depthwise(images))  # (B, 4, 6, 6)
        lines = self.plain(features.flatten(2))  # (B, 4, 36)
        cached = torch.cat([torch.tensor([]), keys], dim=-2)  # (B, H, T, D): an empty cache is skipped
        return lines.sum() + cached.sum()


@pytest.fixture(scope="module")
def cases() -> dict[str, OpCase]:
    torch.manual_seed(0)
    module, example = ConvsAndCaches(), (torch.randn(4, 8, 6, 6), torch.randn(4, 2, 3, 4))
    graph = lnn.trace(module, example)
    inputs = {name: value.detach() for name, value in lnn.bind_inputs(graph, module, example).items()}
    with single_threaded():
        recorded = _recorded(graph, inputs)
    return {op.name: OpCase("convs_and_caches", op, values) for op, values in recorded if op.target.startswith(("aten.conv", "aten.cat"))}


def test_annotations(cases: dict[str, OpCase]) -> None:
    assert {name: case.op.annotation for name, case in cases.items()} == {
        "conv2d": "n c i0^ i1^, c 1 w0^ w1^, c -> n c j0^ j1^; value 0 2",
        "conv2d_1": "n c^ i0^ i1^, o^ k^ w0^ w1^ -> n o^ j0^ j1^; value 0",
        "conv1d": "n c+ i0^, o c+ w0^, o -> n o j0^; value 0 2",
        "cat": "a b e^ d -> a b f^ d; value 0",  # the empty cache is gone
    }


def test_a_cat_skipping_an_empty_operand_splits_by_batch() -> None:
    empty, keys, out = PTensor("empty", (0,), "float32").full(), PTensor("k", (4, 2, 3, 4), "float32").full(), PTensor("y", (4, 2, 3, 4), "float32").full()
    assert annotate_op(Op("cat", "aten.cat.default", ([empty, keys], -2), (), (out,))) == "e^, a b f^ d -> a b g^ d; value 1"


def test_every_allowed_split_is_equivalent(cases: dict[str, OpCase]) -> None:
    checked = []
    with single_threaded():
        for name, case in cases.items():
            for choice, parts in case.allowed_splits():
                check_split(case, choice, parts)
                checked.append((name, choice, parts))
    assert {("conv2d", "n", 4), ("conv2d", "c", 4), ("conv2d_1", "n", 4), ("cat", "a", 4)} <= set(checked)
