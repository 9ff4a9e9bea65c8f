"""Capture refuses what it cannot represent, naming the module or op and the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_nnscaler as lnn

import lightning as L


class DataDependentGate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # Python branch on a tensor value
            return x * 2
        return x


class Network(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 4), DataDependentGate())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x).sum()


def test_untraceable_code_names_the_module_path_and_the_fix() -> None:
    with pytest.raises(lnn.CaptureError) as error:
        lnn.trace(Network(), (torch.randn(2, 4),))
    message = str(error.value)
    assert "'encoder.1'" in message
    assert "torch.where" in message


class InPlaceOnInput(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return x.sum()


def test_in_place_change_of_an_input_is_refused() -> None:
    with pytest.raises(lnn.CaptureError, match="in place"):
        lnn.trace(InPlaceOnInput(), (torch.randn(2, 4),))


class WritesThroughSlice(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shifted = x.new_zeros(x.shape)
        shifted[:, 1:] = x[:, :-1]
        shifted[:, 0] = 1.0
        return (shifted * x).sum()


def test_writes_through_views_reach_their_base() -> None:
    x = torch.randn(3, 5, requires_grad=True)
    graph = lnn.trace(WritesThroughSlice(), (x,))
    assert not any(op.target.split(".")[1].endswith("_") for op in graph.ops)
    traced = lnn.run_graph(graph, {graph.user_inputs[0].name: x})[graph.outputs[0]]
    torch.testing.assert_close(traced, WritesThroughSlice()(x))


def test_training_step_must_return_a_loss() -> None:
    class Step(nn.Module):
        def training_step(self, batch: torch.Tensor, batch_index: int) -> str:
            return "nothing"

    with pytest.raises(lnn.CaptureError, match="must return the loss"):
        lnn.trace(Step(), torch.randn(2), step="training_step")


def test_a_flattened_linear_whose_weight_is_computed_after_the_reshape_is_captured_exactly() -> None:
    """``F.linear(x.reshape(N, E), w * 2).view(*lead, O)``: the weight is written after the reshape, so the
    rewrite that keeps the leading dims apart runs where the linear is (every input it reads known)."""

    class ScaledWeight(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(5, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.linear(x.reshape(6, 4), self.w * 2, bias=None).view(2, 3, 5).square().sum()

    torch.manual_seed(0)
    model, x = ScaledWeight(), torch.randn(2, 3, 4)
    graph = lnn.trace(model, (x,))
    linear = next(op for op in graph.ops if op.target == "aten.linear.default")
    assert linear.outputs[0].shape == (2, 3, 5)
    lnn.parallelize(model, (x,), "dp", 2).verify()


class LitRegressor(nn.Module):
    """Shaped as a LightningModule: ``forward(x)``, and ``training_step`` takes the ``(x, y)`` batch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self(inputs), targets)


def test_a_batch_given_to_forward_is_refused_as_a_wrong_step_not_as_control_flow() -> None:
    batch = (torch.randn(4, 8), torch.randn(4, 4))
    with pytest.raises(lnn.CaptureError) as error:
        lnn.parallelize(LitRegressor(), batch, "dp", 2)
    message = str(error.value)
    assert "LitRegressor.forward(x)" in message and "(Tensor, Tensor)" in message
    assert 'step="training_step"' in message
    assert "torch.where" not in message and "control flow" not in message
    lnn.parallelize(LitRegressor(), batch, "dp", 2, step="training_step").verify()  # the fix the message names works


class StepReturning(nn.Module):
    """A LightningModule-shaped step whose loss is computed as ``mode`` says."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.net = nn.Linear(8, 4)
        self.mode = mode

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> object:
        inputs, targets = batch
        errors = nn.functional.mse_loss(self.net(inputs), targets, reduction="none")
        if self.mode == "per element":
            return errors
        if self.mode == "no loss key":
            return {"los": errors.mean()}
        if self.mode == "item in the math":
            return errors.mean() / errors.mean().item()
        if self.mode == "item compared":
            return errors.mean() * 2 if errors.mean().item() > 1 else errors.mean()
        return errors.mean()


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("per element", r"returned a loss of shape \(4, 4\): backward needs a single number .*loss.mean\(\)"),
        ("no loss key", r"returned a dict with the keys \['los'\] and no 'loss'"),
        ("item in the math", r"calls .item\(\) at .*test_capture_errors.py:\d+ and computes \(truediv\) with its result.*drop .item\(\)"),
        ("item compared", r"calls .item\(\) at .*test_capture_errors.py:\d+ and compares \(gt\) its result"),
    ],
)
def test_a_step_ddp_would_refuse_is_refused_naming_what_and_where(mode: str, message: str) -> None:
    with pytest.raises(lnn.CaptureError, match=message):
        lnn.trace(StepReturning(mode), (torch.randn(4, 8), torch.randn(4, 4)), step="training_step")


class LogsItem(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 4)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        loss = nn.functional.mse_loss(self.net(inputs), targets)
        self.log("loss_value", loss.item(), prog_bar=True)
        self.log("first_weight", self.net.weight[0, 0].item())
        return loss


def test_a_logged_item_is_logged_as_its_tensor_computed_every_step() -> None:
    from lightning_nnscaler.capture.trace import trace_step

    model = LogsItem()
    batch = (torch.randn(4, 8), torch.randn(4, 4))
    traced = trace_step(model, batch)
    assert [(call.name, call.output, call.options) for call in traced.logs] == [
        ("loss_value", 0, {"prog_bar": True}), ("first_weight", 1, {}),
    ]
    plan = lnn.parallelize(model, batch, "dp", 2, step="training_step")
    plan.verify()  # the logged values are graph outputs, equal to one device's
