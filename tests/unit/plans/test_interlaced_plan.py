"""The interlaced pipeline plan: vocabulary layers split over every pipeline rank, verified against one device."""

from __future__ import annotations

import re

import pytest
import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.models.mbart import MBart, MBartConfig


def mbart() -> tuple[MBart, object]:
    torch.manual_seed(0)
    model = MBart(MBartConfig.small())
    return model, model.example_batch(4, torch.Generator().manual_seed(0))


@pytest.mark.parametrize("world_size", [2, 8])
def test_interlaced_mbart_verifies_against_one_device(world_size: int) -> None:
    model, batch = mbart()
    plan = lnn.parallelize(model, batch, "interlaced", world_size, step="training_step")
    report = plan.verify()
    assert report.parameters_checked == len(list(model.parameters()))


def test_the_vocabulary_layers_and_the_loss_are_split_over_every_rank_and_meet_the_pipeline_by_collectives() -> None:
    model, batch = mbart()
    plan = lnn.parallelize(model, batch, "interlaced", 4, step="training_step")
    vocabulary = MBartConfig.small().vocab_size
    for rank, source in enumerate(plan.sources):
        slice_rows = (rank * vocabulary // 4, (rank + 1) * vocabulary // 4)
        for key in ("token_embedding.weight", "lm_head.weight"):
            boxes = re.findall(rf"'{re.escape(key)}', \(\(({slice_rows[0]}, {slice_rows[1]})\), \(0, 32\)\)", source)
            assert boxes, f"rank {rank} should hold rows {slice_rows} of {key}"
        assert "torch.ops.lnn.vocab_embedding.default" in source and "torch.ops.lnn.vocab_loss_parts.default" in source
        assert "comm.all_reduce(" in source and "comm.broadcast(" in source
        assert "comm.all_gather(" not in source  # the logits never cross ranks: the loss adds up two numbers per token
        shared_functions = re.findall(r"^def (stage(?:0|5)_microbatch\d+)\(.*?(?=^def |\Z)", source, re.M | re.S)
        assert shared_functions
        for body in re.findall(r"^def stage(?:0|5)_microbatch\d+\(.*?(?=^def |^SEGMENTS)", source, re.M | re.S):
            assert "comm.send(" not in body and "comm.recv(" not in body  # shared stages: collectives only
    explained = plan.explain()
    assert "shared stages 0 and 5 (interlaced)" in explained
    assert re.search(r"\| 0F0 +\| 0F0 +\| 0F0 +\| 0F0", explained)


def test_interlaced_gpt_verifies_at_4_ranks() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig.small())
    plan = lnn.parallelize(model, model.example_batch(8, torch.Generator().manual_seed(0)), "interlaced", 4, step="training_step")
    plan.verify()


@pytest.mark.parametrize(
    ("config", "params", "message"),
    [
        (GPTConfig(vocab_size=64, seq_len=16, hidden=32, layers=2, heads=4), {}, "no large-vocabulary embedding"),
        (GPTConfig(vocab_size=130, seq_len=16, hidden=32, layers=2, heads=4), {}, r"pad the vocabulary to a multiple of 4"),
        (GPTConfig.small(), {"shared_layers": "no_such_op"}, r"shared_layers names ops the graph does not have: \['no_such_op'\]"),
        (GPTConfig.small(), {"shared_layers": "gelu"}, r"shared_layers \['gelu'\] are neither embedding lookups nor linears"),
    ],
    ids=["small vocabulary", "indivisible vocabulary", "unknown op", "not a vocabulary layer"],
)
def test_what_the_interlaced_plan_cannot_split_is_refused_naming_it(config: GPTConfig, params: dict, message: str) -> None:
    torch.manual_seed(0)
    model = GPT(config)
    with pytest.raises(ValueError, match=message):
        lnn.parallelize(model, model.example_batch(8, torch.Generator().manual_seed(0)), "interlaced", 4, step="training_step", **params)


def test_shared_layers_can_be_named() -> None:
    """Naming only the LM head keeps the token embedding in the first pipeline stage, whole."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.small())
    batch = model.example_batch(8, torch.Generator().manual_seed(0))
    graph = lnn.trace(model, batch, step="training_step")
    head = [op.name for op in graph.ops if op.target == "aten.linear.default" and op.outputs[0].shape[-1] == 128][-1]  # the MLP's fc1 is as wide
    plan = lnn.parallelize(model, batch, "interlaced", 2, step="training_step", shared_layers=head)
    plan.verify()
    assert "'token_embedding.weight', ((0, 128), (0, 32))" in plan.sources[0]
    assert "vocab_embedding" not in plan.sources[0]


class ResidualLM(torch.nn.Module):
    """Written as a user would: the embedding feeds a residual block directly (its first reader also
    reads a pipeline stage's output), optionally a padding row and a head tied to the embedding."""

    def __init__(self, tie: bool, padding_idx: int | None) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(256, 32, padding_idx=padding_idx)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.Linear(32, 32), torch.nn.GELU()) for _ in range(2))
        self.head = torch.nn.Linear(32, 256, bias=False)
        if tie:
            self.head.weight = self.embedding.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = x + block(x)
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


@pytest.mark.parametrize(("tie", "padding_idx"), [(False, None), (True, None), (False, 0)], ids=["untied", "tied head", "padding row"])
def test_a_user_model_whose_embedding_feeds_a_residual_verifies(tie: bool, padding_idx: int | None) -> None:
    torch.manual_seed(0)
    model = ResidualLM(tie, padding_idx)
    tokens = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))
    tokens[:, 0] = 0  # the padding id, whose row gets no gradient
    plan = lnn.parallelize(model, (tokens, torch.randint(0, 256, (8, 16))), "interlaced", 2)
    plan.verify()
    assert "torch.ops.lnn.vocab_embedding.default" in plan.sources[0]
