"""Generated per-rank code: snapshots (it is part of the product) and the hash guard."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import lightning_nnscaler as lnn
from lightning_nnscaler.codegen import StaleCodeError, emit_rank, load_rank_module, save_sources
from lightning_nnscaler.materialize.dependencies import materialize

SNAPSHOTS = Path(__file__).parent / "snapshots"


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x))).sum()


def megatron_two_layers() -> lnn.Graph:
    """Column-parallel first linear, row-parallel second, replicated sum, on 2 ranks."""
    torch.manual_seed(0)
    graph = lnn.trace(TwoLayers(), (torch.randn(4, 8),))
    first, second = (op for op in list(graph.ops) if op.target == "aten.linear.default")
    relu = next(op for op in graph.ops if op.target == "aten.relu.default")
    total = next(op for op in graph.ops if op.target == "aten.sum.default")
    for op, dim in ((first, "n"), (relu, "b"), (second, "k"), (total, "replicate")):
        for device, piece in enumerate(lnn.op_trans(graph, op, dim, 2)):
            lnn.op_assign(graph, piece, device)
    return graph


@pytest.mark.parametrize("rank", [0, 1])
def test_generated_code_matches_snapshot(rank: int) -> None:
    source = emit_rank(materialize(megatron_two_layers(), 2), rank, "snapshot", "megatron two layers")
    path = SNAPSHOTS / f"megatron_two_layers_rank{rank}.py"
    if os.environ.get("UPDATE_SNAPSHOTS"):
        path.write_text(source)
    assert source == path.read_text(), "generated code changed; review the diff and rerun with UPDATE_SNAPSHOTS=1"
    compile(source, str(path), "exec")


class FourLayers(nn.Module):
    """Four linear layers: two pipeline stages of two layers, or ZeRO boxes in several buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.layers(x)).sum()


@pytest.mark.parametrize(("recipe", "rank", "params"), [
    ("1f1b", 1, {"stages": 2, "microbatches": 2}),  # the last stage: boundary receives, its loss, gradients back
    ("zero3", 0, {"bucket_bytes": 300}),  # ZeRO-3: GATHER, REDUCE and FREE of several buckets
])
def test_a_pipeline_rank_and_a_zero3_rank_match_their_snapshots(recipe: str, rank: int, params: dict) -> None:
    torch.manual_seed(0)
    plan = lnn.parallelize(FourLayers(), (torch.randn(4, 8),), recipe, 2, **params)
    source = plan.sources[rank].replace(plan.plan_hash[:12], "<plan hash>")
    path = SNAPSHOTS / f"four_layers_{recipe}_rank{rank}.py"
    if os.environ.get("UPDATE_SNAPSHOTS"):
        path.write_text(source)
    assert source == path.read_text(), "generated code changed; review the diff and rerun with UPDATE_SNAPSHOTS=1"
    compile(source, str(path), "exec")


def test_saved_code_is_reused_and_edits_are_refused(tmp_path: Path) -> None:
    program = materialize(megatron_two_layers(), 2)
    sources = [emit_rank(program, rank, "h", "t") for rank in range(2)]
    root = save_sources(tmp_path, "h" * 64, sources)
    assert save_sources(tmp_path, "h" * 64, sources) == root
    assert load_rank_module(root, 1, sources).HELD
    (root / "rank1.py").write_text(sources[1] + "\n# a local tweak\n")
    with pytest.raises(StaleCodeError, match="rank1.py was edited"):
        load_rank_module(root, 1, sources)
    with pytest.raises(StaleCodeError, match="rank1.py was edited"):
        save_sources(tmp_path, "h" * 64, sources)


def test_an_edit_with_a_rehashed_manifest_is_not_the_plans_code(tmp_path: Path) -> None:
    program = materialize(megatron_two_layers(), 2)
    sources = [emit_rank(program, rank, "h", "t") for rank in range(2)]
    root = save_sources(tmp_path, "h" * 64, sources)
    edited = sources[1] + "\nHELD = None  # a local tweak\n"
    (root / "rank1.py").write_text(edited)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["files"]["rank1.py"] = hashlib.sha256(edited.encode()).hexdigest()
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StaleCodeError, match=r"does not record this plan's code \(rank1.py differ"):
        load_rank_module(root, 1, sources)
    with pytest.raises(StaleCodeError, match="rank1.py differ"):
        save_sources(tmp_path, "h" * 64, sources)
    assert load_rank_module(root, 1, [sources[0], edited]).HELD is None  # the edited code is accepted only as its own plan's
    with pytest.raises(StaleCodeError, match="code for 2 ranks, not for rank 2"):
        load_rank_module(root, 2, sources)


def test_data_parallel_ranks_send_the_target_count_first_and_receive_it_last():
    """The cross-entropy's kept-target count depends on the batch alone: computed and sent before the
    forward pass, it waits for the peer (issued early) instead of making every rank wait mid-step."""
    from lightning_nnscaler.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.small())
    plan = lnn.parallelize(model, model.example_batch(4, torch.Generator().manual_seed(0)), "dp", 2, step="training_step")
    for rank, source in enumerate(plan.sources):
        body = source[source.index("def stage0_microbatch0("):].splitlines()
        send = next(index for index, line in enumerate(body) if "comm.send(" in line)
        recv = next(index for index, line in enumerate(body) if "comm.recv(" in line)
        first_linear = next(index for index, line in enumerate(body) if "aten.linear" in line)
        loss_sum = next(index for index, line in enumerate(body) if line.lstrip().startswith("cross_entropy_loss_sum ="))
        assert "cross_entropy_loss_count" in body[send] and send < first_linear, f"rank {rank}"
        assert recv > loss_sum, f"rank {rank}: the receive stays where the count is needed"


class FlashAttentionThenView(nn.Module):
    """nanoGPT's attention tail: ``y.transpose(1, 2).contiguous().view(B, T, C)`` after flash attention,
    whose ``.contiguous()`` torch.export drops (the output was contiguous when traced)."""

    def __init__(self, hidden: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, length, hidden = x.shape
        q, k, v = (part.view(rows, length, self.heads, -1).transpose(1, 2) for part in self.qkv(x).split(hidden, dim=2))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(rows, length, hidden)).sum()


def test_a_view_is_written_as_reshape_so_that_a_piece_of_any_layout_runs() -> None:
    torch.manual_seed(0)
    plan = lnn.parallelize(FlashAttentionThenView(), (torch.randn(2, 4, 16),), "sp", 2)
    assert all("aten.view.default(" not in source and "aten.reshape.default(" in source for source in plan.sources)
    plan.verify()
