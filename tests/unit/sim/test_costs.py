"""Cost model: spec loading, roofline units and monotonicity, ring α–β, profile cache keys."""

from __future__ import annotations

import pytest

from lightning_nnscaler.ir.op import Op
from lightning_nnscaler.ir.tensor import PTensor
from lightning_nnscaler.sim.costs import CommModel, Roofline, op_work, ring_bytes
from lightning_nnscaler.sim.profile import ProfileDB, Profiled, op_key
from lightning_nnscaler.sim.specs import available_specs, load_spec


def linear(tokens: int, inner: int, outer: int, dtype: str = "float32") -> Op:
    x = PTensor("x", (tokens, inner), dtype).full()
    w = PTensor("w", (outer, inner), dtype, role="parameter").full()
    y = PTensor("y", (tokens, outer), dtype).full()
    return Op("linear", "aten.linear.default", (x, w), outputs=(y,))


def elementwise(target: str, shape: tuple[int, ...], dtype: str = "float32") -> Op:
    a, b, out = (PTensor(name, shape, dtype).full() for name in ("a", "b", "out"))
    return Op("elementwise", target, (a, b), outputs=(out,))


def test_every_shipped_spec_loads_with_datasheet_figures() -> None:
    assert {"v100", "a100", "h100", "h200", "cpu"} <= set(available_specs())
    h100 = load_spec("h100")
    assert h100.flops("bfloat16") == pytest.approx(989.4e12)
    assert load_spec("h200").memory_bandwidth > h100.memory_bandwidth
    assert load_spec("cpu").cores_per_node


def test_an_unknown_spec_names_the_shipped_ones() -> None:
    with pytest.raises(FileNotFoundError, match="a100"):
        load_spec("tpu9")


def test_matmul_flops_are_two_per_multiply_add() -> None:
    work = op_work(linear(64, 128, 256))
    assert work.flops == 2 * 64 * 128 * 256
    assert work.nbytes == 4 * (64 * 128 + 256 * 128 + 64 * 256)
    assert work.matmul and work.has_backward


def test_roofline_grows_with_work_and_is_faster_on_faster_devices() -> None:
    a100 = Roofline(load_spec("a100"))
    small, large = a100.op_time(linear(64, 128, 256)), a100.op_time(linear(4096, 4096, 4096))
    assert large.forward > small.forward > 0
    assert large.backward == pytest.approx(2 * large.forward - a100.spec.op_overhead_s, rel=1e-6)
    big_h100 = Roofline(load_spec("h100")).op_time(linear(4096, 4096, 4096, "bfloat16"))
    assert big_h100.forward < a100.op_time(linear(4096, 4096, 4096, "bfloat16")).forward
    # 2·4096³ FLOPs at 312 TFLOP/s × 0.7: about 0.63 ms
    assert a100.op_time(linear(4096, 4096, 4096, "bfloat16")).forward == pytest.approx(2 * 4096**3 / (312e12 * 0.7), rel=0.05)


def test_ring_bytes_follow_explain_and_inter_node_is_slower() -> None:
    assert ring_bytes("all_reduce", 4, 1000) == 1500
    assert ring_bytes("all_gather", 4, 1000) == 750
    comm = CommModel(load_spec("a100"))
    intra = comm.collective_seconds("all_reduce", tuple(range(8)), 2**30)
    inter = comm.collective_seconds("all_reduce", tuple(range(0, 64, 8)), 2**30)
    assert inter > 5 * intra
    assert comm.collective_seconds("all_reduce", (0,), 2**30) == 0.0
    assert comm.collective_seconds("all_gather", (0, 1), 2**20) < comm.collective_seconds("all_gather", (0, 1), 2**24)


def test_profile_keys_separate_shapes_and_dtypes_and_the_cache_round_trips(tmp_path) -> None:
    assert op_key(linear(64, 128, 256), "cpu") == op_key(linear(64, 128, 256), "cpu")
    assert op_key(linear(64, 128, 256), "cpu") != op_key(linear(64, 128, 512), "cpu")
    assert op_key(linear(64, 128, 256), "cpu") != op_key(linear(64, 128, 256, "float64"), "cpu")
    database = ProfileDB.open(directory=tmp_path)
    model = Profiled(database, Roofline(load_spec("cpu")))
    measured = model.op_time(linear(16, 32, 32))
    assert measured.forward > 0 and measured.backward > 0 and model.misses == 1
    database.save()
    again = Profiled(ProfileDB.open(directory=tmp_path), Roofline(load_spec("cpu")), measure=False)
    assert again.op_time(linear(16, 32, 32)) == measured and again.misses == 0


def test_the_fitted_roofline_recovers_the_overhead_and_the_two_efficiencies_that_made_the_times() -> None:
    from dataclasses import replace

    from lightning_nnscaler.sim.calibrate import fit_roofline
    from lightning_nnscaler.sim.costs import OpTime

    spec = load_spec("h100")
    truth = replace(spec, op_overhead_s=12e-6, matmul_efficiency=0.7, memory_efficiency=0.4)
    matmuls = [linear(tokens, inner, outer) for tokens in (2048, 4096) for inner in (2048, 4096) for outer in (1024, 8192)]
    adds = [elementwise("aten.add.Tensor", (rows, 1024)) for rows in (64, 1024, 16384)]
    ops = matmuls + adds
    times = [Roofline(truth).op_time(op) for op in ops]
    fitted = fit_roofline(spec, ops, times)
    assert fitted == pytest.approx((12e-6, 0.7, 0.4), rel=1e-6)
    model = replace(spec, op_overhead_s=fitted.overhead, matmul_efficiency=fitted.matmul_efficiency, memory_efficiency=fitted.memory_efficiency)
    flat = [seconds for time in (Roofline(model).op_time(op) for op in ops) for seconds in (time.forward, time.backward)]
    assert flat == pytest.approx([seconds for time in times for seconds in (time.forward, time.backward)])
    # a view moves nothing: its measured time, however large, is not fitted
    view = Op("view", "aten.view.default", (PTensor("a", (4, 4)).full(),), outputs=(PTensor("b", (16,)).full(),))
    assert fit_roofline(spec, [*ops, view], [*times, OpTime(1.0, 1.0)]) == pytest.approx(fitted)
    # an efficiency no op is bound by stays the spec's
    assert fit_roofline(spec, adds, times[len(matmuls):]).matmul_efficiency == spec.matmul_efficiency
