"""nn.SyncBatchNorm under dp takes statistics over every replica from all-reduced per-channel sums, never
gathered activations (issue 34): one device's BatchNorm over the global batch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lightning_nnscaler as lnn
from lightning_nnscaler.capture.sync_batch_norm import sync_batch_norm_traced
from lightning_nnscaler.ir.rules.batch_norm import SYNC_MOMENTS, SYNC_RUNNING_STATISTICS
from lightning_nnscaler.verify import evaluate

CHANNELS = 8


class ConvNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, CHANNELS, 3, padding=1), nn.BatchNorm2d(CHANNELS), nn.ReLU(), nn.MaxPool2d(2), nn.AdaptiveAvgPool2d(1)
        )
        self.head = nn.Linear(CHANNELS, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.head(self.features(x).flatten(1)), y)


def _batch(rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(rows, 3, 8, 8, generator=generator) * 2 + 1, torch.randint(0, 4, (rows,), generator=generator)


def _models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    plain = ConvNormNet()
    return plain, nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(plain))


def test_sync_batch_norm_is_captured_as_per_channel_sums_and_elementwise_normalization() -> None:
    graph = lnn.trace(_models()[1], _batch())
    ops = {op.name: op for op in graph.ops}
    assert not any("batch_norm" in op.target for op in graph.ops if op.target not in (SYNC_MOMENTS, SYNC_RUNNING_STATISTICS))
    assert ops["batch_norm_sum"].annotation == "a+ b c+ d+ -> b; value 0"  # splitting the batch leaves a partial sum
    assert ops["batch_norm_moments"].annotation == "c, c -> c, c"  # reads the sums whole: they are all-reduced here
    assert ops["batch_norm_centered"].annotation.startswith("a b c d, b 1 1 -> a b c d")
    by_key = {graph.tensors[name].state_key: new for name, new in graph.buffer_updates.items()}
    assert by_key["features.1.running_mean"] == "batch_norm_running_0" and by_key["features.1.running_var"] == "batch_norm_running_1"


def test_captured_sync_batch_norm_equals_batch_norm_over_the_batch() -> None:
    """Loss, every gradient and the new running statistics (unbiased variance) of BatchNorm in eager mode."""
    plain, synced = _models()
    batch = _batch()
    graph = lnn.trace(synced, batch)
    by_key = {graph.tensors[name].state_key: new for name, new in graph.buffer_updates.items()}
    graph.outputs = [*graph.outputs, *by_key.values()]
    result = evaluate(graph, lnn.bind_inputs(graph, synced, batch), backward_from=graph.outputs[:1])
    loss = plain(*batch)
    loss.backward()
    torch.testing.assert_close(result.outputs[graph.outputs[0]], loss)
    for name, gradient in result.gradients.items():
        key = graph.tensors[name].state_key
        if key is not None:
            torch.testing.assert_close(gradient, plain.get_parameter(key).grad, msg=lambda text, key=key: f"{key}: {text}")
    for key, new in by_key.items():
        torch.testing.assert_close(result.outputs[new], plain.get_buffer(key), msg=lambda text, key=key: f"{key}: {text}")


@pytest.mark.parametrize("recipe", ["dp", "zero3"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_sync_batch_norm_under_dp_exchanges_per_channel_sums_only_and_verifies(recipe: str, world_size: int) -> None:
    plain, synced = _models()
    batch = _batch()
    params = {"stages": 1} if recipe == "zero3" else {}  # one stage: the sums are the step's only messages
    plan = lnn.parallelize(synced, batch, recipe, world_size, **params)
    exchanged = {line.split("comm.send(token, ")[1].split(",")[0] for source in plan.sources for line in source.splitlines() if "comm.send(" in line}
    assert exchanged == {"batch_norm_sum", "batch_norm_sum_of_squares", "cross_entropy_loss_count"}
    # Against the same model's plain-BatchNorm plan (per-replica statistics, gradients only): each rank sends
    # its two partial sums (C floats each) to the others forward, and their gradients backward.
    extra = plan.memory_rows()[0]["communication"] - lnn.parallelize(plain, batch, recipe, world_size, **params).memory_rows()[0]["communication"]
    assert extra == (world_size - 1) * 2 * 2 * CHANNELS * 4, extra
    plan.verify()  # against one device: SyncBatchNorm over the global batch is BatchNorm over it


@pytest.mark.parametrize("world_size", [2, 4])
def test_sync_batch_norm_under_zero3_one_layer_at_a_time_verifies(world_size: int) -> None:
    """zero3's stages run one microbatch: each stage's forward sees the replica's whole batch, so the statistics
    are the global batch's (the sums may cross stages as messages)."""
    plan = lnn.parallelize(_models()[1], _batch(), "zero3", world_size)
    assert plan.pipeline is not None  # features.0 and features.1: two layers, two stages
    plan.verify()


def test_tracing_restores_sync_batch_norm_forward() -> None:
    original = nn.SyncBatchNorm.forward
    with sync_batch_norm_traced():
        assert nn.SyncBatchNorm.forward is not original
    assert nn.SyncBatchNorm.forward is original


@pytest.mark.parametrize("recipe", ["gpipe", "1f1b"])
def test_sync_batch_norm_under_a_pipeline_is_refused_naming_the_fix(recipe: str) -> None:
    with pytest.raises(ValueError, match=rf"{recipe}: nn.SyncBatchNorm \(.*\) needs statistics over the whole batch.*use nn.BatchNorm"):
        lnn.parallelize(_models()[1], _batch(), recipe, 2)
