"""What each recipe splits and where it puts the pieces: masks, devices, recompute groups, errors."""

from __future__ import annotations

import pytest
from plans_support import traced

import lightning_nnscaler as lnn
from lightning_nnscaler.plans import PlanContext, dp, hybrid, tp
from lightning_nnscaler.plans.hybrid import HybridConfig
from lightning_nnscaler.plans.megatron_tp import TensorParallelConfig


def _pieces(plan: lnn.Graph, state_key: str) -> list[lnn.Op]:
    """The pieces of the linear whose weight is ``state_key``."""
    return [op for op in plan.ops if op.target == "aten.linear.default" and op.args[1].tensor.state_key == state_key]


def _pieces_of(plan: lnn.Graph, target: str, index: int = 0) -> list[lnn.Op]:
    """The pieces of the ``index``-th captured op with ``target``."""
    origins = list(dict.fromkeys(op.source_name for op in plan.ops if op.target == target))
    return [op for op in plan.ops if op.source_name == origins[index]]


def _ranges(pieces: list[lnn.Op], input_index: int, dim: int) -> list[tuple[int, int]]:
    return [piece.tensor_inputs[input_index].index.ranges[dim] for piece in pieces]


def test_tp_splits_attention_heads_and_ffn(gpt) -> None:
    plan, _ = gpt.plan("tp", 2)
    query = _pieces(plan, "blocks.0.attn.q_proj.weight")  # column: output features (weight rows)
    assert [piece.device for piece in query] == [0, 1]
    assert _ranges(query, 1, 0) == [(0, 16), (16, 32)]
    attention = _pieces_of(plan, "aten.scaled_dot_product_attention.default")
    assert [piece.device for piece in attention] == [0, 1]
    assert all(_ranges(attention, position, 1) == [(0, 2), (2, 4)] for position in range(3))  # heads
    out_proj = _pieces(plan, "blocks.0.attn.out_proj.weight")  # row: reduction dim, partial sums
    assert _ranges(out_proj, 1, 1) == [(0, 16), (16, 32)]
    assert [piece.outputs[0].value.part for piece in out_proj] == [0, 1]
    assert [piece.tensor_inputs[2].value.parts for piece in out_proj] == [2, 2]  # the bias is added once
    fc1, fc2 = _pieces(plan, "blocks.0.mlp.fc1.weight"), _pieces(plan, "blocks.0.mlp.fc2.weight")
    assert _ranges(fc1, 1, 0) == [(0, 64), (64, 128)] and _ranges(fc2, 1, 1) == [(0, 64), (64, 128)]
    assert all(piece.outputs[0].value.parts == 2 for piece in fc2)
    for replicated in (_pieces_of(plan, "aten.layer_norm.default"), _pieces(plan, "lm_head.weight")):
        assert [piece.device for piece in replicated] == [0, 1]
        assert all(piece.outputs[0].is_full for piece in replicated)


def test_sp_splits_the_ops_between_linears_along_the_sequence(gpt) -> None:
    plan, _ = gpt.plan("sp", 2)
    for target in ("aten.embedding.default", "aten.layer_norm.default", "aten.add.Tensor", "aten.dropout.default"):
        pieces = _pieces_of(plan, target, 0 if target == "aten.embedding.default" else 1)  # token embedding, block ops
        assert [piece.outputs[0].index.ranges[1] for piece in pieces] == [(0, 8), (8, 16)], target
    query = _pieces(plan, "blocks.0.attn.q_proj.weight")
    assert _ranges(query, 1, 0) == [(0, 16), (16, 32)] and all(piece.tensor_inputs[0].is_full for piece in query)


def test_dp_splits_the_batch_and_leaves_the_loss_value_partial(gpt) -> None:
    plan, context = gpt.plan("dp", 4)
    assert context.zero_stage == 0
    by_origin: dict[str, list[lnn.Op]] = {}
    for op in plan.ops:
        by_origin.setdefault(op.source_name, []).append(op)
    assert all([piece.device for piece in pieces] == [0, 1, 2, 3] for pieces in by_origin.values())
    assert _ranges(_pieces(plan, "blocks.0.mlp.fc1.weight"), 0, 0) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    loss = [op for op in plan.ops if op.outputs and op.outputs[0].name == plan.outputs[0]]
    assert [(piece.outputs[0].value.part, piece.outputs[0].value.parts) for piece in loss] == [(j, 4) for j in range(4)]


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_is_dp_plus_a_sharding_stage(gpt, stage) -> None:
    plan, context = gpt.plan(f"zero{stage}", 2, **({"stages": 1} if stage == 3 else {}))
    assert context.zero_stage == stage
    assert str(plan) == str(gpt.plan("dp", 2)[0])


def test_zero3_by_default_gathers_one_layer_at_a_time(gpt) -> None:
    plan, context = gpt.plan("zero3", 2)
    dp, _ = gpt.plan("dp", 2)
    assert context.zero_stage == 3
    from lightning_nnscaler.plans.stage_cuts import model_layers

    layers = model_layers(gpt.graph, list(gpt.graph.ops))[1]  # blocks.0, blocks.1
    assert context.pipeline is not None and len(context.pipeline.schedule.stage_ranks) == layers == 2
    pieces = lambda graph: sorted((op.source_name, op.device) for op in graph.ops)  # noqa: E731
    assert pieces(plan) == pieces(dp)  # the same pieces as dp, cut into one stage per layer


def test_coshard_puts_shards_per_device_and_recompute_groups() -> None:
    gpt = traced("gpt", 4)
    plan, _ = gpt.plan("coshard", 2, shards=2)
    attention = _pieces_of(plan, "aten.scaled_dot_product_attention.default")
    assert [piece.device for piece in attention] == [0, 0, 1, 1]
    assert _ranges(attention, 0, 1) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert len({piece.recompute for piece in attention}) == 4 and None not in {piece.recompute for piece in attention}
    query = _pieces(plan, "blocks.0.attn.q_proj.weight")
    assert [piece.recompute for piece in query] == [piece.recompute for piece in attention]  # one group per shard
    fc1 = _pieces(plan, "blocks.0.mlp.fc1.weight")
    assert not {piece.recompute for piece in fc1} & {piece.recompute for piece in attention}  # the MLP's own groups
    assert all(piece.recompute is None for piece in _pieces_of(plan, "aten.layer_norm.default"))
    without, _ = gpt.plan("coshard", 2, shards=2, recompute=False)
    assert all(op.recompute is None for op in without.ops)


def test_hybrid_lays_out_devices_replica_major() -> None:
    gpt = traced("gpt", 4)
    plan, _ = gpt.plan("hybrid", 4, dp=2, tp=2)
    query = _pieces(plan, "blocks.0.attn.q_proj.weight")
    layout = {(piece.tensor_inputs[0].index.ranges[0], piece.tensor_inputs[1].index.ranges[0]): piece.device for piece in query}
    # (batch rows, weight rows) -> device = replica * tp + piece
    assert layout == {((0, 2), (0, 16)): 0, ((0, 2), (16, 32)): 1, ((2, 4), (0, 16)): 2, ((2, 4), (16, 32)): 3}
    assert str(plan) == str(gpt.plan("tp", 4, degree=2)[0])


def test_plan_errors_name_the_parameters(gpt) -> None:
    with pytest.raises(ValueError, match=r"hybrid: dp \(2\) × tp \(3\) = 6 must equal world_size \(4\)"):
        hybrid(gpt.graph.copy(), PlanContext(4), HybridConfig(dp=2, tp=3))
    with pytest.raises(ValueError, match=r"tp: degree \(3\) must be a positive divisor of world_size \(4\)"):
        tp(gpt.graph.copy(), PlanContext(4), TensorParallelConfig(degree=3))
    with pytest.raises(ValueError, match=r"input %batch_0 has batch size 4, which 8 does not divide"):
        dp(gpt.graph.copy(), PlanContext(8))
    with pytest.raises(ValueError, match="zero_stage"):
        PlanContext(2, zero_stage=2)
