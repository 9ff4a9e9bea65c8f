"""Per-slice reads of sharded checkpoints (``checkpoint.read_pieces``): saved by the real ``save_sharded`` under one
layout (tensor-parallel boxes on dim 0 or 1, ZeRO chunks, replicas, world sizes 1-4), read under another, every
model piece and Adam state equal to the full tensors' pieces; a rank reads about its share of the bytes and only
the files that hold it; a missing key, a shape mismatch, an uncovered box and damaged files are refused by name."""

from __future__ import annotations

import json
import math
import random
import threading
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from support.threads import ThreadGather

from lightning_nnscaler import checkpoint
from lightning_nnscaler.checkpoint import CheckpointError, layout, rank_file_name, read_pieces
from lightning_nnscaler.checkpoint.integrity import hash_bytes
from lightning_nnscaler.checkpoint.overlap import gather, overlaps
from lightning_nnscaler.ir.box import Box, PieceLocation, full_box
from lightning_nnscaler.strategy import checkpoint as strategy_checkpoint

SHAPES = {"w": (8, 12), "b": (8,), "e": (5, 3)}
MOMENTS = ("exp_avg", "exp_avg_sq")
Plan = Callable[[int, dict[str, tuple[int, ...]]], tuple[list[PieceLocation], list[PieceLocation]]]


def _state(shapes: dict[str, tuple[int, ...]]) -> dict[str, dict[str, torch.Tensor]]:
    """The full values: each tensor, and its Adam moments."""
    generator = torch.Generator().manual_seed(0)
    return {
        name: {key: torch.randn(shape, generator=generator) for key, shape in shapes.items()}
        for name in ("value", *MOMENTS)
    }


class Model(torch.nn.Module):
    """The saved module: its shapes, and ``tied`` (the same parameter as ``e``)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__()
        for key, shape in shapes.items():
            setattr(self, key, torch.nn.Parameter(torch.zeros(shape)))
        self.tied = self.e


def _split(size: int, parts: int, index: int) -> tuple[int, int]:
    bounds = [round(size * part / parts) for part in range(parts + 1)]
    return bounds[index], bounds[index + 1]


def _cut(shape: tuple[int, ...], dim: int, parts: int, index: int) -> Box:
    box = list(full_box(shape))
    box[dim] = _split(shape[dim], parts, index)
    return tuple(box)


def _chunks(location: PieceLocation, parts: int, index: int) -> PieceLocation:
    size = math.ceil(math.prod(stop - start for start, stop in location.box) / parts)
    return PieceLocation(location.state_key, location.box, (index, size))


def _tp(cuts: dict[str, int], parts: int, zero: int = 1, zero3: bool = False) -> tuple[int, Plan]:
    """Tensor parallel over ``parts`` (tensor -> the dim it is cut on; others replicated), ZeRO over ``zero`` replicas of
    each box (the optimizer state; with ``zero3`` the model too: a plan to read under, never saved so)."""
    def plan(rank: int, shapes: dict[str, tuple[int, ...]]) -> tuple[list[PieceLocation], list[PieceLocation]]:
        tp, dp = divmod(rank, zero)
        boxes = [PieceLocation(key, _cut(shape, cuts[key], parts, tp) if key in cuts else full_box(shape)) for key, shape in shapes.items()]
        chunks = [_chunks(location, zero, dp) if zero > 1 else location for location in boxes]
        return (chunks if zero3 else boxes), chunks
    return parts * zero, plan


LAYOUTS: dict[str, tuple[int, Plan]] = {
    "single": _tp({}, 1),
    "replicated": _tp({}, 2),
    "tp2_rows": _tp({"w": 0, "b": 0}, 2),
    "tp2_cols": _tp({"w": 1, "e": 0}, 2),
    "tp3_cols": _tp({"w": 1, "b": 0, "e": 1}, 3),
    "zero4": _tp({}, 1, zero=4),
    "tp2_zero2": _tp({"w": 0, "b": 0}, 2, zero=2),
    "zero3_4": _tp({}, 1, zero=4, zero3=True),
}


def save(
    path: Path, layout_name: str, shapes: dict[str, tuple[int, ...]] = SHAPES, *, optimizer: bool = True, drop: str | None = None
) -> dict:
    """``save_sharded`` of the full state cut by the layout, its ranks as threads; ``drop`` a key no rank holds past rank 0."""
    world_size, plan = LAYOUTS[layout_name]
    state = _state(shapes)
    gather, errors = ThreadGather(world_size, timeout=30), []

    def rank_main(rank: int) -> None:
        gather.enter(rank)
        model, optimizer_locations = plan(rank, shapes)
        model = [location for location in model if not (drop == location.state_key and rank > 0)]
        pieces = [(location, location.take(state["value"][location.state_key])) for location in model]
        states = [
            (location, {"step": torch.tensor(7.0), **{name: location.take(state[name][location.state_key]) for name in MOMENTS}})
            for location in optimizer_locations
        ]
        lightning_checkpoint = {"global_step": 7, "epoch": 1, "state_dict": {}, "loops": {"fit_loop": {"epoch": 1}}}
        if optimizer:
            lightning_checkpoint["optimizer_states"] = [{"state": {}, "param_groups": [{"lr": 0.1, "params": list(range(len(shapes)))}]}]
        try:
            strategy_checkpoint.save_sharded(
                lightning_checkpoint, path, rank=rank, world_size=world_size, module=Model(shapes), model_pieces=pieces,
                optimizer_pieces=[states], group_keys=[[list(shapes)]], gather=gather,
                plan={"recipe": layout_name, "recipe_params": {}, "plan_hash": "0" * 64},
            )
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)
            gather.abort()

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    return state


def check_read(path: Path, layout_name: str, state: dict, shapes: dict[str, tuple[int, ...]] = SHAPES) -> list[checkpoint.PieceRead]:
    """Read every rank's pieces of ``layout_name``; each equals the full tensors' piece, model and Adam state."""
    world_size, plan = LAYOUTS[layout_name]
    reads = []
    for rank in range(world_size):
        model, optimizer = plan(rank, shapes)
        read = read_pieces(path, model, [optimizer], shapes=shapes)
        for location in model:
            assert torch.equal(read.model[location], location.take(state["value"][location.state_key])), (rank, location)
        for location in optimizer:
            got = read.optimizers[0][location]
            assert sorted(got) == ["exp_avg", "exp_avg_sq", "step"]
            assert got["step"].dim() == 0 and float(got["step"]) == 7.0
            for name in MOMENTS:
                assert torch.equal(got[name], location.take(state[name][location.state_key])), (rank, location, name)
        reads.append(read)
    return reads


SAVED_AS = ["replicated", "tp2_rows", "tp2_cols", "zero4", "tp2_zero2"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict]]:
    """One checkpoint per saving layout."""
    root = tmp_path_factory.mktemp("saved")
    return {name: (root / f"{name}.ckpt", save(root / f"{name}.ckpt", name)) for name in SAVED_AS}


@pytest.mark.parametrize("saved_as", SAVED_AS)
@pytest.mark.parametrize("read_as", ["single", "tp2_rows", "tp3_cols", "zero4", "tp2_zero2"])
def test_any_layout_reads_back_under_any_other(saved: dict, saved_as: str, read_as: str) -> None:
    path, state = saved[saved_as]
    reads = check_read(path, read_as, state)
    common = reads[0].common
    assert (common["global_step"], common["loops"]) == (7, {"fit_loop": {"epoch": 1}}) and "state_dict" not in common
    assert common["optimizer_states"] == [{"state": {}, "param_groups": [{"lr": 0.1, "params": [0, 1, 2]}]}]
    assert reads[0].metadata["param_group_keys"] == [[["w", "b", "e"]]]


def test_a_rank_opens_only_the_files_that_hold_its_pieces(saved: dict) -> None:
    path, _ = saved["tp2_rows"]
    _, plan = LAYOUTS["tp2_rows"]
    model, optimizer = plan(1, SHAPES)
    assert read_pieces(path, model[:2], [optimizer[:2]]).files_read == ["rank00001-of-00002.pt"]  # w and b (rank 0 writes e)
    model, optimizer = LAYOUTS["zero3_4"][1](0, SHAPES)  # its chunks: rows 0-1 of w, b[0:2], e[0:1], in rank 0's rows (e: rank 0 writes it)
    assert read_pieces(path, model, [optimizer]).files_read == ["rank00000-of-00002.pt"]
    path, _ = saved["zero4"]
    assert read_pieces(path, [], [[_chunks(PieceLocation("w", full_box((8, 12))), 4, 2)]]).files_read == ["rank00002-of-00004.pt"]


def _held_bytes(location: PieceLocation) -> int:
    """The float32 bytes of a piece, less a chunk's padding."""
    numel = math.prod(stop - start for start, stop in location.box)
    if location.chunk is not None:
        numel = max(0, min(location.chunk[1], numel - location.chunk[0] * location.chunk[1]))
    return 4 * numel


@pytest.mark.parametrize(
    ("saved_as", "read_as"), [("tp2_cols", "zero3_4"), ("zero4", "tp2_rows"), ("tp2_zero2", "tp3_cols"), ("replicated", "zero3_4")]
)
def test_a_rank_reads_its_share_of_the_bytes(tmp_path: Path, saved_as: str, read_as: str) -> None:
    shapes = {"w": (96, 128), "b": (96,), "e": (40, 24)}
    state = save(tmp_path / "big.ckpt", saved_as, shapes)
    total = sum(tensor.numel() * tensor.element_size() for values in state.values() for tensor in values.values())
    for rank, read in enumerate(check_read(tmp_path / "big.ckpt", read_as, state, shapes)):
        model, optimizer = LAYOUTS[read_as][1](rank, shapes)
        assert read.bytes_read == sum(map(_held_bytes, model)) + sum(2 * _held_bytes(location) + 4 for location in optimizer)  # + step
        if read_as == "zero3_4":
            assert 0.24 < read.bytes_read / total < 0.26
        assert read.bytes_hashed == sum(read.metadata["files"][name]["size"] for name in read.files_read)


def test_a_checkpoint_without_the_index_is_read_from_its_files(tmp_path: Path) -> None:
    path = tmp_path / "old.ckpt"
    state = save(path, "tp2_rows")
    forge_metadata(path, lambda metadata: metadata.pop("pieces"))
    reads = check_read(path, "tp3_cols", state)
    assert [read.files_read for read in reads] == [["rank00000-of-00002.pt", "rank00001-of-00002.pt"]] * 3
    _, plan = LAYOUTS["tp2_rows"]
    assert read_pieces(path, plan(0, SHAPES)[0]).files_read == ["rank00000-of-00002.pt"]  # its pickle read, rank 1's tensors not


def test_a_tied_key_reads_its_group_s_pieces(saved: dict) -> None:
    path, state = saved["tp2_cols"]
    location = PieceLocation("tied", ((1, 4), (0, 3)))
    read = read_pieces(path, [location], [[location]])
    assert torch.equal(read.model[location], state["value"]["e"][1:4])
    assert torch.equal(read.optimizers[0][location]["exp_avg"], state["exp_avg"]["e"][1:4])


def forge_metadata(path: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    """Edit the current save's metadata and re-record its hash in CURRENT (a writer's bug or an earlier version, not damage)."""
    directory = layout.current_save(path)[0]
    metadata = json.loads((directory / "metadata.json").read_text())
    edit(metadata)
    text = json.dumps(metadata).encode()
    (directory / "metadata.json").write_bytes(text)
    pointer = json.loads((path / "CURRENT").read_text())
    (path / "CURRENT").write_text(json.dumps({**pointer, "metadata_size": len(text), "metadata_hash": hash_bytes(text)}))


def test_a_missing_key_a_shape_mismatch_and_a_box_outside_are_refused(saved: dict) -> None:
    path, _ = saved["tp2_rows"]
    with pytest.raises(CheckpointError, match=r"'nope' is not in the checkpoint .*load a checkpoint of this model"):
        read_pieces(path, [PieceLocation("nope", ((0, 1),))])
    with pytest.raises(CheckpointError, match=r"'w' is \[8, 12\] in the checkpoint .* but \[8, 13\] in the model"):
        read_pieces(path, [PieceLocation("w", ((0, 4), (0, 12)))], shapes={"w": (8, 13)})
    with pytest.raises(CheckpointError, match=r"box \[\[0, 9\], \[0, 12\]\] of 'w' does not fit its shape \[8, 12\]"):
        read_pieces(path, [PieceLocation("w", ((0, 9), (0, 12)))])
    with pytest.raises(CheckpointError, match=r"'w' is no parameter of optimizer 0|optimizer state of 2 optimizer"):
        read_pieces(path, [], [[], [PieceLocation("w", ((0, 4), (0, 12)))]])


def test_a_box_the_saved_pieces_do_not_cover_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "lost.ckpt"
    state = save(path, "tp2_rows", drop="w")  # rank 1 holds rows 4-7 of w but writes nothing of it
    rows = PieceLocation("w", ((0, 4), (0, 12)))
    assert torch.equal(read_pieces(path, [rows]).model[rows], state["value"]["w"][:4])
    uncovered = r"'w': the saved pieces do not cover the wanted box \[\[2, 6\], \[0, 12\]\] \(24 of its 48 elements .*element \[4, 0\]"
    with pytest.raises(CheckpointError, match=uncovered):
        read_pieces(path, [PieceLocation("w", ((2, 6), (0, 12)))])
    with pytest.raises(CheckpointError, match=r"do not cover the wanted ZeRO chunk 1 \(of 48 elements\) of box \[\[0, 8\], \[0, 12\]\]"):
        read_pieces(path, [PieceLocation("w", full_box((8, 12)), (1, 48))])


def test_optimizer_state_of_a_weights_only_checkpoint_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "weights.ckpt"
    state = save(path, "tp2_rows", optimizer=False)
    location = PieceLocation("b", ((2, 6),))
    assert torch.equal(read_pieces(path, [location]).model[location], state["value"]["b"][2:6])
    with pytest.raises(CheckpointError, match="optimizer state of 1 optimizer.*holds 0 .*save_weights_only"):
        read_pieces(path, [location], [[location]])


def test_damaged_files_are_refused_when_read_and_not_opened_when_not_needed(tmp_path: Path) -> None:
    path = tmp_path / "damaged.ckpt"
    state = save(path, "tp2_rows")
    file = layout.current_save(path)[0] / rank_file_name(1, 2)
    data = bytearray(file.read_bytes())
    offset = bytes(data).find(state["value"]["w"][4:].numpy().tobytes())
    data[offset + 5] ^= 0x10
    file.write_bytes(bytes(data))
    top, bottom = PieceLocation("w", ((0, 4), (0, 12))), PieceLocation("w", ((4, 8), (0, 12)))
    assert read_pieces(path, [top]).files_read == ["rank00000-of-00002.pt"]
    with pytest.raises(CheckpointError, match=r"rank00001-of-00002.pt has content hash .*; the metadata says .*corrupted"):
        read_pieces(path, [bottom])
    file.write_bytes(bytes(data[:-10]))
    with pytest.raises(CheckpointError, match=r"rank00001-of-00002.pt is \d+ bytes; the metadata says \d+ bytes: the file was truncated"):
        read_pieces(path, [bottom], verify=False)


def test_a_file_that_disagrees_with_the_index_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "forged.ckpt"
    save(path, "tp2_rows")
    forge_metadata(path, lambda metadata: metadata["pieces"]["rank00001-of-00002.pt"]["model"][0].__setitem__(1, "3:8,0:12"))
    disagrees = r"rank00001-of-00002.pt holds 2 model piece\(s\), the metadata's index lists 2 for it, not the same"
    with pytest.raises(CheckpointError, match=disagrees):
        read_pieces(path, [PieceLocation("w", ((4, 8), (0, 12)))], verify=False)


def test_any_piece_put_together_from_any_saved_pieces_equals_its_take() -> None:
    """Random shapes (0-3 dims), saved as boxes cut on a random dim, some of them in ZeRO chunks; a random wanted
    box or chunk (the last ones all padding): ``overlap.gather`` equals ``take``, copying each element once."""
    rng = random.Random(0)
    for _ in range(400):
        shape = tuple(rng.randrange(1, 6) for _ in range(rng.randrange(0, 4)))
        full = torch.randn(shape)
        dim = rng.randrange(len(shape)) if shape else 0
        parts = rng.randrange(1, 4)
        saved = []
        for part in range(parts if shape else 1):
            box = _cut(shape, dim, parts, part) if shape else ()
            if math.prod(stop - start for start, stop in box) == 0:
                continue
            zero = rng.randrange(1, 4)
            saved += [_chunks(PieceLocation("k", box), zero, index) for index in range(zero)] if zero > 1 else [PieceLocation("k", box)]
        box = tuple(tuple(sorted(rng.sample(range(size + 1), 2))) for size in shape)  # start < stop
        zero = rng.randrange(1, 5)
        wanted = _chunks(PieceLocation("k", box), zero, rng.randrange(zero + 1)) if rng.random() < 0.5 else PieceLocation("k", box)
        sources = [(location, (lambda values: lambda: values)(location.take(full)), "file")
                   for location in saved if overlaps(wanted, location)]
        values, copied = gather(wanted, sources, full.dtype, "'k'")
        assert torch.equal(values, wanted.take(full)), (shape, saved, wanted)
        real = math.prod(stop - start for start, stop in box)
        if wanted.chunk is not None:
            real = max(0, min(wanted.chunk[1], real - wanted.chunk[0] * wanted.chunk[1]))
        assert copied == 4 * real
