"""Pretrained safetensors read per slice: each tensor-parallel rank gets its boxes' values and reads only their bytes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lightning_nnscaler.checkpoint.integrity import CheckpointError
from lightning_nnscaler.checkpoint.pretrained import read_slices, safetensors_files
from lightning_nnscaler.ir.box import Box, full_box, region
from lightning_nnscaler.models.gpt import GPT, GPTConfig

WORLD_SIZE = 4


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    """A small GPT's weights (contiguous copies: safetensors refuses shared storages)."""
    torch.manual_seed(0)
    return {key: value.detach().clone().contiguous() for key, value in GPT(GPTConfig.small()).state_dict().items()}


def tensor_parallel_box(key: str, shape: tuple[int, ...], rank: int) -> Box:
    """Megatron-style: q/k/v/fc1 and embeddings split by rows, out_proj/fc2 by columns, the rest replicated."""
    box = list(full_box(shape))
    dim = 1 if key.endswith(("out_proj.weight", "fc2.weight")) else 0 if key.endswith(("proj.weight", "fc1.weight", "embedding.weight", "lm_head.weight")) else None
    if dim is not None:
        size = shape[dim] // WORLD_SIZE
        box[dim] = (rank * size, (rank + 1) * size)
    return tuple(box)


def is_split(key: str) -> bool:
    return tensor_parallel_box(key, (8, 8), 1) != full_box((8, 8))


def save_sharded(state: dict[str, torch.Tensor], directory: Path, *, index: bool) -> None:
    """Two shards (half the keys each), with or without ``model.safetensors.index.json``."""
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for file, shard_keys in shards.items():
        save_file({key: state[key] for key in shard_keys}, str(directory / file))
    if index:
        weight_map = {key: file for file, shard_keys in shards.items() for key in shard_keys}
        (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def check_ranks(source: Path, state: dict[str, torch.Tensor]) -> None:
    """Every rank's boxes equal the full tensors' slices; a rank reads a quarter of the split tensors' bytes."""
    split_bytes = sum(value.numel() * value.element_size() for key, value in state.items() if is_split(key))
    replicated_bytes = sum(value.numel() * value.element_size() for key, value in state.items() if not is_split(key))
    for rank in range(WORLD_SIZE):
        wanted = {key: tensor_parallel_box(key, tuple(value.shape), rank) for key, value in state.items()}
        tensors, bytes_read = read_slices(source, wanted)
        assert tensors.keys() == state.keys()
        for key, box in wanted.items():
            assert torch.equal(tensors[key], state[key][region(box)]), f"rank {rank}: {key}"
        assert bytes_read == split_bytes // WORLD_SIZE + replicated_bytes
        split_only = read_slices(source, {key: box for key, box in wanted.items() if is_split(key)})
        assert split_only.bytes_read == split_bytes // WORLD_SIZE


def test_each_rank_reads_its_boxes_from_one_file(state: dict[str, torch.Tensor], tmp_path: Path) -> None:
    file = tmp_path / "weights.safetensors"
    save_file(state, str(file))
    check_ranks(file, state)
    (tmp_path / "model").mkdir()
    save_file(state, str(tmp_path / "model" / "model.safetensors"))
    check_ranks(tmp_path / "model", state)


def test_each_rank_reads_its_boxes_from_shards_with_an_index(state: dict[str, torch.Tensor], tmp_path: Path) -> None:
    save_sharded(state, tmp_path, index=True)
    files = safetensors_files(tmp_path)
    assert {file.name for file in files.values()} == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    check_ranks(tmp_path, state)


def test_shards_without_an_index_are_read_together(state: dict[str, torch.Tensor], tmp_path: Path) -> None:
    save_sharded(state, tmp_path, index=False)
    check_ranks(tmp_path, state)


def test_whole_tensors_key_map_and_dtype(state: dict[str, torch.Tensor], tmp_path: Path) -> None:
    file = tmp_path / "hub.safetensors"
    save_file({f"transformer.{key}": value for key, value in state.items()}, str(file))
    key = "blocks.0.mlp.fc1.weight"
    tensors, bytes_read = read_slices(file, {key: None, "ln_f.bias": ((2, 5),)}, dtype=torch.bfloat16, key_map=lambda name: f"transformer.{name}")
    assert torch.equal(tensors[key], state[key].to(torch.bfloat16))
    assert torch.equal(tensors["ln_f.bias"], state["ln_f.bias"][2:5].to(torch.bfloat16))
    assert bytes_read == state[key].numel() * 4 + 3 * 4  # the stored float32 bytes, not the cast ones


def test_missing_key_names_the_key_the_file_and_the_key_map(state: dict[str, torch.Tensor], tmp_path: Path) -> None:
    file = tmp_path / "weights.safetensors"
    save_file(state, str(file))
    with pytest.raises(CheckpointError, match=r"'model.lm_head.weight' is not in .*weights.safetensors \(\d+ tensors.*pass a key_map"):
        read_slices(file, {"model.lm_head.weight": None})
    with pytest.raises(CheckpointError, match=r"'lm_head.weight' \(stored name 'x.lm_head.weight'\) is not in .*key_map"):
        read_slices(file, {"lm_head.weight": None}, key_map=lambda key: f"x.{key}")


def test_box_that_does_not_fit_the_stored_shape_is_refused(state: dict[str, torch.Tensor], tmp_path: Path) -> None:
    file = tmp_path / "weights.safetensors"
    save_file(state, str(file))
    rows, columns = state["lm_head.weight"].shape
    with pytest.raises(CheckpointError, match=rf"box \[\[0, {rows + 1}\], \[0, {columns}\]\] of 'lm_head.weight' does not fit its stored shape \[{rows}, {columns}\] in .*weights.safetensors.*configuration"):
        read_slices(file, {"lm_head.weight": ((0, rows + 1), (0, columns))})
    with pytest.raises(CheckpointError, match=r"box \[\[0, 4\]\] of 'lm_head.weight' does not fit its stored shape"):
        read_slices(file, {"lm_head.weight": ((0, 4),)})


def test_damaged_sources_are_refused_with_what_to_do(state: dict[str, torch.Tensor], tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist: pass a .safetensors file"):
        read_slices(tmp_path / "absent", {})
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no .safetensors file"):
        read_slices(tmp_path / "empty", {})
    save_sharded(state, tmp_path, index=True)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"names shard\(s\) \['model-00002-of-00002.safetensors'\] that are not in"):
        read_slices(tmp_path, {"lm_head.weight": None})
    (tmp_path / "twice").mkdir()
    save_file({"w": torch.ones(2)}, str(tmp_path / "twice" / "a.safetensors"))
    save_file({"w": torch.zeros(2)}, str(tmp_path / "twice" / "b.safetensors"))
    with pytest.raises(CheckpointError, match=r"'w' is stored in both .*a.safetensors and .*b.safetensors"):
        read_slices(tmp_path / "twice", {"w": None})
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(CheckpointError, match="broken.safetensors is not a readable safetensors file"):
        read_slices(broken, {"w": None})


def test_quarter_boxes_of_a_large_tensor_read_a_quarter_of_its_bytes(tmp_path: Path) -> None:
    weight = torch.randn(1024, 512)
    save_file({"weight": weight}, str(tmp_path / "big.safetensors"))
    reads = [read_slices(tmp_path / "big.safetensors", {"weight": ((0, 1024), (rank * 128, (rank + 1) * 128))}) for rank in range(WORLD_SIZE)]
    assert [read.bytes_read for read in reads] == [weight.numel() * 4 // WORLD_SIZE] * WORLD_SIZE
    assert torch.equal(torch.cat([read.tensors["weight"] for read in reads], dim=1), weight)
    assert math.prod(reads[0].tensors["weight"].shape) == weight.numel() // WORLD_SIZE
