"""The sharded checkpoint format (lightning_nnscaler.checkpoint) in one process: atomic commit,
incomplete or damaged directories refused, and assembly of boxes, ZeRO chunks and tied keys.
(Fault injection, save by save and step by step: test_checkpoint_faults.py.)"""

from __future__ import annotations

from pathlib import Path

import lightning
import pytest
import torch

from lightning_nnscaler import checkpoint
from lightning_nnscaler.checkpoint import (
    COMMON, SAVE_RECORD, CheckpointError, commit, partial_directory, rank_file_name, rank_payload, save_directory, write_atomically,
)
from lightning_nnscaler.ir.box import PieceLocation

WEIGHT = torch.arange(24.0).reshape(4, 6)
BIAS = torch.arange(4.0)


def _metadata() -> dict:
    return {
        "world_size": 2, "recipe": "tp", "recipe_params": {}, "plan_hash": "0" * 64,
        "state_keys": ["weight", "bias", "tied_bias"], "shapes": {"weight": [4, 6], "bias": [4], "tied_bias": [4]},
        "dtypes": {"weight": "float32", "bias": "float32", "tied_bias": "float32"}, "tied": [["bias", "tied_bias"]],
        "param_group_keys": [[["weight", "bias"]]],
    }


def _write(path: Path, token: str, scale: float = 1.0) -> Path:
    """Rank 0 holds weight rows 0-1, rank 1 rows 2-3; the bias's Adam state is in two ZeRO chunks of 3 (padded)."""
    partial = partial_directory(path, token)
    partial.mkdir(parents=True)
    moments = BIAS * 10 * scale
    rank_pieces = [
        ([(PieceLocation("weight", ((0, 2), (0, 6))), WEIGHT[:2] * scale), (PieceLocation("bias", ((0, 4),)), BIAS * scale)],
         [[(PieceLocation("weight", ((0, 2), (0, 6))), {"step": torch.tensor(3.0), "exp_avg": WEIGHT[:2] * 2}),
           (PieceLocation("bias", ((0, 4),), (0, 3)), {"step": torch.tensor(3.0), "exp_avg": moments[:3]})]]),
        ([(PieceLocation("weight", ((2, 4), (0, 6))), WEIGHT[2:] * scale)],
         [[(PieceLocation("weight", ((2, 4), (0, 6))), {"step": torch.tensor(3.0), "exp_avg": WEIGHT[2:] * 2}),
           (PieceLocation("bias", ((0, 4),), (1, 3)), {"step": torch.tensor(3.0), "exp_avg": torch.cat([moments[3:], torch.zeros(2)])})]]),
    ]
    save = {"token": token, "world_size": 2, "global_step": int(scale)}
    for rank, (model, optimizers) in enumerate(rank_pieces):
        write_atomically(rank_payload(model, optimizers, save={**save, "rank": rank}), partial / rank_file_name(rank, 2))
    groups = [{"lr": 0.1, "params": [0, 1]}]
    common = {"global_step": int(scale), "pytorch-lightning_version": lightning.__version__, "optimizer_states": [{"param_groups": groups}]}
    write_atomically({**common, SAVE_RECORD: {**save, "rank": 0}}, partial / COMMON)
    return partial


def test_load_assembles_boxes_zero_chunks_and_tied_keys(tmp_path: Path) -> None:
    path = tmp_path / "epoch=0.ckpt"
    commit(_write(path, "a"), path, _metadata())
    loaded = checkpoint.load(path)
    torch.testing.assert_close(loaded["state_dict"]["weight"], WEIGHT)
    torch.testing.assert_close(loaded["state_dict"]["tied_bias"], BIAS)
    state = loaded["optimizer_states"][0]["state"]
    torch.testing.assert_close(state[0]["exp_avg"], WEIGHT * 2)
    torch.testing.assert_close(state[1]["exp_avg"], BIAS * 10)  # chunks joined, padding dropped
    assert float(state[1]["step"]) == 3.0
    assert loaded["optimizer_states"][0]["param_groups"] == [{"lr": 0.1, "params": [0, 1]}]


def test_merge_writes_a_plain_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "epoch=0.ckpt"
    commit(_write(path, "a"), path, _metadata())
    checkpoint.merge(path, tmp_path / "merged.ckpt")
    plain = torch.load(tmp_path / "merged.ckpt", weights_only=True)
    torch.testing.assert_close(plain["state_dict"]["weight"], WEIGHT)


def test_a_new_checkpoint_replaces_one_of_the_same_name_only_when_complete(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    commit(_write(path, "a"), path, _metadata())
    unfinished = _write(path, "b", scale=2.0)  # every file written, but the save stopped before its commit
    assert checkpoint.load(path)["global_step"] == 1
    with pytest.raises(CheckpointError, match="has no CURRENT: it is not a finished"):
        checkpoint.load(unfinished)
    commit(unfinished, path, _metadata())
    assert checkpoint.load(path)["global_step"] == 2
    assert [child.name for child in tmp_path.iterdir()] == ["last.ckpt"]
    assert sorted(child.name for child in path.iterdir()) == ["CURRENT", "save-b"]  # the earlier save is gone


def test_a_damaged_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "epoch=0.ckpt"
    commit(_write(path, "a"), path, _metadata())
    (save_directory(path, "a") / rank_file_name(1, 2)).write_bytes(b"truncated")
    with pytest.raises(CheckpointError, match=r"rank00001-of-00002.pt is 9 bytes; the metadata says \d+ bytes"):
        checkpoint.load(path)


def test_a_tensor_no_piece_covers_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "epoch=0.ckpt"
    partial = _write(path, "a")
    write_atomically(rank_payload([], [[]], save={"token": "a", "rank": 1, "world_size": 2}), partial / rank_file_name(1, 2))  # rank 1's rows are lost
    commit(partial, path, _metadata())
    with pytest.raises(CheckpointError, match="do not hold all of 'weight'"):
        checkpoint.load(path)


class Tiny(lightning.LightningModule):
    """Parameters named as the synthetic checkpoint's (``tied_bias`` is ``bias``)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(4, 6))
        self.bias = torch.nn.Parameter(torch.zeros(4))
        self.tied_bias = self.bias


def test_load_from_checkpoint_reads_a_sharded_checkpoint_through_open_merged(tmp_path: Path) -> None:
    path = tmp_path / "epoch=0.ckpt"
    commit(_write(path, "a"), path, _metadata())
    model = Tiny.load_from_checkpoint(checkpoint.open_merged(path))
    torch.testing.assert_close(model.weight.detach(), WEIGHT)
    assert model.tied_bias is model.bias
