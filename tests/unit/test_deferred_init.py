"""Deferred init: a module recorded on the meta device materializes, whole or one box at a time, bit for bit as eager
construction under the same seed builds it, and leaves the generator where eager construction leaves it."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from typing import Callable

import pytest
import torch
from torch import nn

from lightning_nnscaler.init import DeferredInitError, recording_init
from lightning_nnscaler.ir.box import Box, PieceLocation, full_box, region
from lightning_nnscaler.models.gpt import GPT, GPTConfig


def tied_gpt() -> GPT:
    """The project's GPT (its ``init_transformer_weights`` and scaled residual projections) with the LM head tied to the token embedding."""
    model = GPT(GPTConfig.small())
    model.lm_head.weight = model.token_embedding.weight
    return model


class CustomInit(nn.Module):
    """Inits outside ``reset_parameters``' usual ops: rejection sampling, QR, Python data, buffers computed from parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.truncated = nn.Parameter(nn.init.trunc_normal_(torch.empty(64, 24), std=0.02))  # torch draws by rejection
        self.orthogonal = nn.Parameter(nn.init.orthogonal_(torch.empty(12, 8), gain=0.5))
        self.dirac = nn.Parameter(nn.init.dirac_(torch.empty(4, 4, 3)))
        self.register_buffer("positions", torch.arange(10.0).unsqueeze(1) * torch.tensor([1.0, 0.5, 0.25]))  # (10, 3)
        self.mixed = nn.Parameter(torch.tensor([[1.0, 2.0], [3.0, 4.0]]) * self.truncated[0, :2].detach().abs() + torch.randn(2, 2))
        with torch.no_grad():
            self.orthogonal[1:3].div_(4.0)
        self.register_buffer("converted", torch.as_tensor(torch.linspace(0.0, 1.0, 5), dtype=torch.float64).cpu() * 2)
        self.seeded = nn.Parameter(nn.init.normal_(torch.empty(5), std=2.0, generator=torch.Generator().manual_seed(7)))  # its own generator


BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "linear": lambda: nn.Linear(24, 40),
    "embedding_with_padding": lambda: nn.Embedding(30, 16, padding_idx=3),
    "layer_norm": lambda: nn.LayerNorm(20),
    "conv2d": lambda: nn.Conv2d(4, 8, kernel_size=3),
    "batch_norm": lambda: nn.BatchNorm2d(6),
    "multihead_attention": lambda: nn.MultiheadAttention(16, 4),
    "transformer_encoder_layer": lambda: nn.TransformerEncoderLayer(16, 4, dim_feedforward=32),
    "transformer_encoder": lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32), 2, enable_nested_tensor=False),  # deep-copies a layer
    "gpt_tied": tied_gpt,
    "custom_init": CustomInit,
}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes: equal bits, not just equal values (-0.0 is not 0.0 here)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def same_bits(first: torch.Tensor, second: torch.Tensor) -> bool:
    return first.dtype == second.dtype and first.shape == second.shape and torch.equal(bits(first), bits(second))


def build_both(build: Callable[[], nn.Module], seed: int) -> tuple[nn.Module, nn.Module, object, torch.Tensor]:
    """(eager module, recorded module, its record, the generator state eager construction left)."""
    torch.manual_seed(seed)
    eager = build()
    eager_state = torch.get_rng_state()
    torch.manual_seed(seed)
    with recording_init("cpu") as record:
        recorded = build()
    return eager, recorded, record, eager_state


def quarter_boxes(shape: tuple[int, ...]) -> list[Box]:
    """Four row blocks (as tensor parallelism cuts), and a corner box over every dim."""
    if not shape:
        return [()]
    rows = math.ceil(shape[0] / 4)
    boxes = [((start, min(start + rows, shape[0])), *full_box(shape[1:])) for start in range(0, shape[0], rows)]
    return boxes + [tuple((size // 3, size) for size in shape)]


@pytest.mark.parametrize("seed", [0, 1234])
@pytest.mark.parametrize("name", list(BUILDERS))
def test_recorded_tensors_and_boxes_equal_eager_bit_for_bit(name: str, seed: int) -> None:
    eager, recorded, record, eager_state = build_both(BUILDERS[name], seed)
    assert torch.equal(torch.get_rng_state(), eager_state), "the generator must advance as eager construction advances it"
    expected = eager.state_dict()
    assert all(value.is_meta for value in recorded.state_dict().values())
    for key, value in expected.items():
        assert same_bits(record.materialize(recorded, key), value), key
        for box in quarter_boxes(tuple(value.shape)):
            assert same_bits(record.materialize(recorded, key, box), value[region(box)].contiguous()), (key, box)
    assert torch.equal(torch.get_rng_state(), eager_state), "replays must leave the caller's generator as it was"


@pytest.mark.parametrize("name", ["multihead_attention", "gpt_tied", "custom_init"])
def test_materialized_module_equals_eager(name: str) -> None:
    eager, recorded, record, eager_state = build_both(BUILDERS[name], seed=5)
    record.materialize_module(recorded)
    assert not [key for key, value in recorded.state_dict().items() if value.is_meta]
    for (key, value), (other_key, other) in zip(eager.state_dict().items(), recorded.state_dict().items(), strict=True):
        assert key == other_key and same_bits(value, other), key
    assert [name for name, _ in eager.named_parameters()] == [name for name, _ in recorded.named_parameters()]
    assert all(isinstance(parameter, nn.Parameter) and parameter.requires_grad for parameter in recorded.parameters())
    assert torch.equal(torch.get_rng_state(), eager_state), "materializing must not move the caller's generator"


def test_dropout_after_construction_draws_as_in_eager_run() -> None:
    torch.manual_seed(3)
    eager = tied_gpt()
    eager_mask = nn.functional.dropout(torch.ones(64), p=0.5)
    torch.manual_seed(3)
    with recording_init() as record:
        recorded = tied_gpt()
    recorded_mask = nn.functional.dropout(torch.ones(64), p=0.5)
    assert torch.equal(eager_mask, recorded_mask)
    record.materialize_module(recorded)
    tokens = torch.randint(0, 128, (2, 16))
    assert torch.equal(eager(tokens), recorded(tokens))


def test_tied_weights_are_one_tensor_under_several_keys() -> None:
    _, recorded, record, _ = build_both(tied_gpt, seed=0)
    assert record.tied_keys(recorded) == [("token_embedding.weight", "lm_head.weight")]
    assert same_bits(record.materialize(recorded, "lm_head.weight"), record.materialize(recorded, "token_embedding.weight"))
    record.materialize_module(recorded)
    assert recorded.lm_head.weight is recorded.token_embedding.weight
    assert isinstance(recorded.lm_head.weight, nn.Parameter) and recorded.lm_head.weight.requires_grad


def test_pieces_and_zero_chunks_of_one_storage_come_from_one_replay() -> None:
    eager, recorded, record, _ = build_both(tied_gpt, seed=2)
    weight = eager.state_dict()["lm_head.weight"]  # (128, 32), tied
    locations = [
        PieceLocation("lm_head.weight", ((0, 64), (0, 32))),
        PieceLocation("token_embedding.weight", ((64, 128), (0, 32))),
        PieceLocation("blocks.0.mlp.fc1.weight", ((0, 128), (0, 32)), chunk=(1, 1500)),  # ZeRO: flat chunk, zero-padded
    ]
    pieces = record.materialize_pieces(recorded, locations, device="cpu")
    assert same_bits(pieces[0], weight[:64]) and same_bits(pieces[1], weight[64:])
    assert same_bits(pieces[2], locations[2].take(eager.state_dict()["blocks.0.mlp.fc1.weight"]))
    half = record.materialize(recorded, "blocks.1.attn.q_proj.weight", ((0, 16), (0, 32)), dtype=torch.bfloat16)
    assert same_bits(half, eager.state_dict()["blocks.1.attn.q_proj.weight"][:16].to(torch.bfloat16))


def test_printing_a_recorded_tensor_inside_the_block_reads_no_values() -> None:
    with recording_init() as record:
        layer = nn.Linear(3, 2)
        text = repr(layer.weight)
    assert "meta" in text and record.materialize(layer, "weight").shape == (2, 3)


library = torch.library.Library("deferred_init_test", "DEF")  # an op with a CPU kernel and no meta one
library.define("scramble_(Tensor(a!) self) -> Tensor(a!)")
library.impl("scramble_", lambda tensor: tensor.mul_(-1), "CPU")


class Scrambled(nn.Linear):
    def reset_parameters(self) -> None:
        super().reset_parameters()
        torch.ops.deferred_init_test.scramble_(self.weight.data)


class DataDependent(nn.Linear):
    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.weight.abs().max() > 0.5:  # reads values
            self.weight.data.mul_(0.5)


def test_what_cannot_be_replayed_is_refused_naming_the_op_the_tensor_the_place_and_the_fix() -> None:
    with pytest.raises(DeferredInitError, match=r"deferred_init_test.scramble_.* on float32\[2, 3\] at .*test_deferred_init.py:\d+ in reset_parameters .*Build this module eagerly"):
        with recording_init():
            Scrambled(3, 2)
    with pytest.raises(DeferredInitError, match=r"_local_scalar_dense.* at .*test_deferred_init.py:\d+ in reset_parameters reads the values of bool\[\].*after materialization"):
        with recording_init():
            DataDependent(3, 2)
    with pytest.raises(DeferredInitError, match=r"random op aten.bernoulli.* draws with parameters from the meta tensor float32\[4\].*Pass numbers"):
        with recording_init():
            torch.bernoulli(torch.full((4,), 0.5))
    with pytest.raises(DeferredInitError, match=r"writes the real tensor float32\[3\] from the recorded meta tensor float32\[3\].*Create that tensor on the default \(meta\) device"):
        with recording_init():
            torch.zeros(3, device="cpu").copy_(torch.ones(3))
    with pytest.raises(DeferredInitError, match="do not nest"):
        with recording_init(), recording_init():
            pass
    assert "is_meta" not in torch.Tensor.__dict__ and torch.nn.init._no_grad_trunc_normal_.__module__ == "torch.nn.init"


def test_materializing_what_the_record_does_not_hold_is_refused() -> None:
    with recording_init() as record:
        layer = nn.Linear(3, 2)
        with pytest.raises(DeferredInitError, match="materialize weight after the recording_init block has ended"):
            record.materialize(layer, "weight")
    with torch.no_grad():
        layer.weight.normal_()  # on meta, after the block: not recorded
    with pytest.raises(DeferredInitError, match=r"weight \(float32\[2, 3\]\) was changed in place after the recording_init block ended.*reset_parameters"):
        record.materialize(layer, "weight")
    with pytest.raises(DeferredInitError, match=r"'bias.grad' names no parameter or buffer of Linear"):
        record.materialize(layer, "bias.grad")
    with pytest.raises(DeferredInitError, match=r"box \[\(0, 3\)\] does not fit bias of shape \[2\]"):
        record.materialize(layer, "bias", ((0, 3),))
    with recording_init() as uninitialized:
        holder = nn.Module()
        holder.raw = nn.Parameter(torch.empty(4, 2))
    with pytest.raises(DeferredInitError, match=r"raw \(float32\[4, 2\]\) was allocated by aten.empty.memory_format and never initialized.*empty_init=True"):
        uninitialized.materialize_module(holder)
    outside = nn.Linear(3, 2, device="meta")
    with pytest.raises(DeferredInitError, match=r"weight \(float32\[2, 3\]\) is on the meta device but was not created under this recording_init"):
        record.materialize(outside, "weight")
    with pytest.raises(ValueError, match="not 'meta'"):
        with recording_init("meta"):
            pass


PEAK_SCRIPT = textwrap.dedent(
    """
    import json, torch
    from torch import nn
    from lightning_nnscaler.init import recording_init

    def memory(field):  # bytes, from /proc/self/status (VmRSS: now; VmHWM: the peak since the last reset)
        return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field))

    def reset_peak():
        with open("/proc/self/clear_refs", "w") as file:
            file.write("5")

    with recording_init() as warm_up:  # loads the code paths (and their pages) before measuring
        tiny = nn.Sequential(nn.Linear(4, 4))
    warm_up.materialize_module(tiny)
    figures = {}
    reset_peak(); start = memory("VmRSS")
    with recording_init() as record:
        model = nn.Sequential(*[nn.Linear(1024, 2048) for _ in range(8)])  # 8 weights of 8 MiB
    figures["record"] = memory("VmHWM") - start
    reset_peak(); start = memory("VmRSS")
    pieces = [record.materialize(model, f"{index}.weight", ((512, 1024), (0, 1024))) for index in range(8)]  # quarter row blocks
    figures["boxes"] = memory("VmHWM") - start
    figures["kept"] = sum(piece.numel() * piece.element_size() for piece in pieces)
    reset_peak(); start = memory("VmRSS")
    record.materialize_module(model)
    figures["module"] = memory("VmRSS") - start
    print(json.dumps(figures))
    """
)


def test_materializing_boxes_holds_about_one_parameter_not_the_model() -> None:
    """Measured in a fresh process (glibc maps large blocks, so freed ones leave the resident set at once)."""
    environment = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    result = subprocess.run([sys.executable, "-c", PEAK_SCRIPT], capture_output=True, text=True, env=environment, timeout=300)
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout.splitlines()[-1])
    parameter, model = 8 * 2**20, 64 * 2**20
    assert figures["record"] < 1.5 * parameter, figures  # one random op's stand-in at a time
    assert figures["boxes"] - figures["kept"] < 1.5 * parameter, figures  # the pieces kept, plus one full weight while cutting
    assert figures["module"] >= 0.9 * model, figures  # the measurement sees a whole materialization
