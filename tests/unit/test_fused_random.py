"""The fused (compiled) plan-invariant draw gives the eager draw's values bit for bit, and falls back to it."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from lightning_nnscaler.ir import fused_random
from lightning_nnscaler.ir.randomness import RandomStream, eager_random_box, op_key, random_box, using_stream

pytestmark = pytest.mark.timeout(600)

KEY = op_key("dropout")
BOXES = [  # (full size, box size, offset): canonical ranks 1, 2 and 3
    ([8, 16, 24], [8, 16, 24], [0, 0, 0]),
    ([1000], [700], [300]),
    ([8, 16, 16, 16], [8, 8, 16, 16], [0, 8, 0, 0]),
    ([6, 10, 12, 1], [3, 4, 5, 1], [2, 6, 7, 0]),
    ([4, 6, 8, 10], [4, 3, 8, 5], [0, 3, 0, 5]),
]


@pytest.fixture
def fused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused path for every box, with no kernel turned off by an earlier test."""
    monkeypatch.setenv(fused_random.ENVIRONMENT, "1")
    monkeypatch.setitem(fused_random._state, "off", {})


@pytest.mark.parametrize(("size", "offset", "full", "canonical"), [
    ([8, 16, 24], [0, 0, 0], [8, 16, 24], (0, [3072], [1])),
    ([8, 8, 16, 16], [0, 8, 0, 0], [8, 16, 16, 16], (2048, [8, 2048], [4096, 1])),
    ([3, 4, 5, 1], [2, 6, 7, 0], [6, 10, 12, 1], (319, [3, 4, 5], [120, 12, 1])),
    ([4, 1, 5], [0, 2, 0], [4, 3, 5], (10, [4, 5], [15, 1])),
    ([4, 3, 1], [0, 0, 2], [4, 3, 5], (2, [12], [5])),
    ([1, 1], [2, 3], [4, 5], (13, [], [])),
])
def test_a_box_reduces_to_its_canonical_form(size: list[int], offset: list[int], full: list[int], canonical: tuple) -> None:
    assert fused_random.canonical_box(size, offset, full) == canonical
    start, sizes, strides = canonical
    everything = torch.arange(math.prod(full)).view(full)
    box = everything[tuple(slice(o, o + s) for o, s in zip(offset, size))]
    if sizes:
        expected = start + sum(torch.arange(n).view([-1] + [1] * (len(sizes) - d - 1)) * s for d, (n, s) in enumerate(zip(sizes, strides)))
        assert torch.equal(box.reshape(sizes), expected)


@pytest.mark.usefixtures("fused")
@pytest.mark.parametrize(("distribution", "threads"), [("uniform", 1), ("uniform", 2), ("normal", 2)])
def test_fused_draws_equal_eager_ones_bit_for_bit(distribution: str, threads: int) -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)  # CPU kernels are compiled for a thread count (one: no OpenMP loop)
    try:
        check_boxes(distribution, BOXES if (distribution, threads) == ("uniform", 2) else BOXES[:3])  # ranks 1 and 2 (fewer compiles)
    finally:
        torch.set_num_threads(previous)
    assert not fused_random._state["off"]


def check_boxes(distribution: str, boxes: list[tuple[list[int], list[int], list[int]]]) -> None:
    """Each of ``boxes`` drawn from two streams: fused equals eager."""
    for stream in (RandomStream(), RandomStream(seed=3, step=7, draw=1)):
        with using_stream(stream):
            for full, size, offset in boxes:
                expected = eager_random_box(size, offset, full, KEY, distribution)
                assert torch.equal(random_box(size, offset, full, KEY, distribution), expected), (stream, size, offset)


@pytest.mark.usefixtures("fused")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_fused_draws_in_other_dtypes_equal_eager_ones(dtype: torch.dtype) -> None:
    full, size, offset = BOXES[2]
    for distribution in ("uniform", "normal") if dtype == torch.bfloat16 else ("uniform",):
        drawn = random_box(size, offset, full, KEY, distribution, dtype)
        assert drawn.dtype == dtype and torch.equal(drawn, eager_random_box(size, offset, full, KEY, distribution, dtype))
    assert not fused_random._state["off"]


@pytest.mark.usefixtures("fused")
def test_new_box_shapes_of_a_rank_do_not_recompile() -> None:
    from torch._dynamo.utils import counters

    random_box([64, 48], [0, 0], [64, 48], KEY)  # rank 1 compiled (or already)
    random_box([64, 48], [1, 1], [65, 49], KEY)  # rank 2
    before = counters["stats"]["unique_graphs"]
    for rows, columns in ((100, 24), (7, 1000), (2, 2)):
        assert torch.equal(random_box([rows, columns], [1, 1], [rows + 1, columns + 1], KEY),
                           eager_random_box([rows, columns], [1, 1], [rows + 1, columns + 1], KEY))
        flat = ([rows * columns], [5], [rows * columns + 5])
        assert torch.equal(random_box(*flat, KEY), eager_random_box(*flat, KEY))
    assert counters["stats"]["unique_graphs"] == before


def captured_dropout(x: torch.Tensor, offset: list[int], full: list[int], p: float) -> torch.Tensor:
    """Dropout as capture writes it (``capture.random_ops``), by the eager draw."""
    compare = torch.float64 if x.dtype == torch.float64 else torch.float32
    return x * (eager_random_box(list(x.shape), offset, full, KEY, "uniform", compare) >= p) * (1.0 / (1.0 - p))


@pytest.mark.usefixtures("fused")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_dropout_forward_and_backward_equal_the_captured_graph(dtype: torch.dtype) -> None:
    full, size, offset = BOXES[2]
    x = torch.randn(size, generator=torch.Generator().manual_seed(0)).to(dtype)
    gradient = torch.randn(size, generator=torch.Generator().manual_seed(1)).to(dtype)
    fused_x, eager_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    fused_y, eager_y = fused_random.dropout_box(fused_x, offset, full, KEY, 0.1), captured_dropout(eager_x, offset, full, 0.1)
    assert torch.equal(fused_y, eager_y)
    fused_y.backward(gradient)
    eager_y.backward(gradient)
    assert torch.equal(fused_x.grad, eager_x.grad)
    assert not fused_random._state["off"]


@pytest.mark.usefixtures("fused")
def test_fused_dropout_compares_with_p_rounded_as_eager_ops_round_it() -> None:
    full, size, offset = BOXES[2]
    uniform = eager_random_box(size, offset, full, KEY)
    value = float(uniform[(uniform >= 0.5) & (uniform < 0.9)][0])
    p = value + 2.0**-26  # above a drawn uniform, but equal to it in float32: eager keeps that element
    x = torch.ones(size)
    assert torch.equal(fused_random.dropout_box(x, offset, full, KEY, p), captured_dropout(x, offset, full, p))


def test_small_boxes_and_a_disabled_fused_path_draw_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(fused_random.ENVIRONMENT, raising=False)
    assert fused_random.fused_box([64, 64], [0, 0], [64, 64], KEY, "uniform", torch.float32, torch.device("cpu")) is None
    monkeypatch.setenv(fused_random.ENVIRONMENT, "0")
    assert fused_random.fused_box([512, 512], [0, 0], [512, 512], KEY, "uniform", torch.float32, torch.device("cpu")) is None
    assert torch.equal(random_box([512, 512], [0, 0], [512, 512], KEY), eager_random_box([512, 512], [0, 0], [512, 512], KEY))
    x = torch.randn(300, 300)
    assert torch.equal(fused_random.dropout_box(x, [0, 0], [300, 300], KEY, 0.3), captured_dropout(x, [0, 0], [300, 300], 0.3))


def test_a_failing_compiler_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(name: str, variant: tuple) -> None:
        raise RuntimeError("no C++ compiler")

    monkeypatch.setenv(fused_random.ENVIRONMENT, "1")
    monkeypatch.setattr(fused_random, "_state", {"off": {}, "checked": set(), "compiled": {}})
    monkeypatch.setattr(fused_random, "_compiled", broken)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        first = random_box([40, 50], [0, 0], [40, 50], KEY, "normal")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x = torch.randn(40, 50, requires_grad=True)
        dropped = fused_random.dropout_box(x, [0, 0], [40, 50], KEY, 0.5)
        second = random_box([40, 50], [0, 0], [40, 50], KEY)
    assert torch.equal(first, eager_random_box([40, 50], [0, 0], [40, 50], KEY, "normal"))
    assert torch.equal(second, eager_random_box([40, 50], [0, 0], [40, 50], KEY))
    assert torch.equal(dropped, captured_dropout(x, [0, 0], [40, 50], 0.5))


def test_a_kernel_whose_values_differ_is_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    def off_by_one_bit(name: str, variant: tuple):
        return lambda bases, dtype, *extents: fused_random.KERNELS[name](bases, dtype, *extents).nextafter(torch.tensor(2.0))

    monkeypatch.setenv(fused_random.ENVIRONMENT, "1")
    monkeypatch.setattr(fused_random, "_state", {"off": {}, "checked": set(), "compiled": {}})
    monkeypatch.setattr(fused_random, "_compiled", off_by_one_bit)
    with pytest.warns(RuntimeWarning, match="differ from the eager draw"):
        drawn = random_box([40, 50], [0, 0], [40, 50], KEY)
    assert torch.equal(drawn, eager_random_box([40, 50], [0, 0], [40, 50], KEY))
    assert set(fused_random._state["off"]) == {"uniform"}
