"""The predicted activation peak (what autograd saves, ``ir.saved``) against the peak metered while
the plan's generated code runs (``sim.meter``, every rank in this process as ``Plan.verify`` runs them)."""

from __future__ import annotations

import pytest
import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.ir.op import Op
from lightning_nnscaler.ir.tensor import PTensor
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.models.mbart import MBart, MBartConfig
from lightning_nnscaler.sim import predict
from lightning_nnscaler.ir.saved import saved_by
from support.saved import metered_peaks


def _model(name: str):
    torch.manual_seed(0)
    if name == "gpt":
        model = GPT(GPTConfig(vocab_size=128, seq_len=16, hidden=32, layers=2, heads=2))
    else:
        model = MBart(MBartConfig(vocab_size=128, seq_len=16, hidden=32, encoder_layers=1, decoder_layers=1, heads=2))
    model.log = lambda *args, **kwargs: None
    return model, model.example_batch(4, torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name, recipe, world_size, params", [
    ("gpt", "dp", 1, {}), ("mbart", "dp", 1, {}), ("gpt", "tp", 2, {}), ("gpt", "1f1b", 2, {"stages": 2, "microbatches": 2}),
    ("gpt", "coshard", 2, {"shards": 1, "recompute": True}),  # a recomputed group keeps its inputs from outside it
])
def test_predicted_activation_peak_is_within_10_percent_of_the_metered_one(name: str, recipe: str, world_size: int, params: dict) -> None:
    model, batch = _model(name)
    plan = lnn.parallelize(model, batch, recipe, world_size, step="training_step", **params)
    predicted = [row["activations"] for row in predict(plan, "cpu").memory]
    measured = metered_peaks(plan)
    assert all(value > 0 for value in measured)
    for rank, (guess, truth) in enumerate(zip(predicted, measured, strict=True)):
        assert abs(guess / truth - 1) <= 0.10, f"rank {rank}: predicted {guess} B, metered {truth} B"


def _piece(name: str, shape: tuple[int, ...], role: str = "activation"):
    return PTensor(name, shape, role=role).full()


def test_an_op_is_measured_on_meta_and_sorted_into_inputs_outputs_and_views() -> None:
    x, weight = _piece("x", (4, 8)), _piece("w", (16, 8), "parameter")
    linear = saved_by(Op("linear", "aten.linear.default", (x, weight), outputs=(_piece("y", (4, 16)),)), [True, True])
    assert (linear.inputs, linear.outputs, linear.internal_bytes) == ((0, 1), (), 0)
    relu = saved_by(Op("relu", "aten.relu.default", (x,), outputs=(_piece("r", (4, 8)),)), [True])
    assert (relu.inputs, relu.outputs) == ((), (0,))
    view = saved_by(Op("view", "aten.view.default", (x, [32]), outputs=(_piece("v", (32,)),)), [True])
    assert (view.inputs, view.outputs, view.aliases) == ((), (), ((0, 0),))
    constant_weight = saved_by(Op("linear", "aten.linear.default", (x, weight), outputs=(_piece("y", (4, 16)),)), [False, True])
    assert constant_weight.inputs == (0,)  # only the input is needed for the weight's gradient


def test_an_op_that_cannot_run_on_meta_gives_none() -> None:
    x = _piece("x", (4, 8))
    assert saved_by(Op("nonzero", "aten.nonzero.default", (x,), outputs=(_piece("n", (3, 2)),)), [True]) is None
