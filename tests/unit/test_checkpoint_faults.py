"""Fault injection for sharded checkpoints, in one process: each broken-file class is refused by ``load``,
``ckpt info --verify`` and ``ckpt merge`` with a message naming the file; an overwrite killed at any
file-system step of its commit leaves the old or the new checkpoint loadable at the path.

Saves go through the strategy's real ``save_sharded`` with two "ranks" as threads (``save``); the
cases are plain functions (``CASES``) so that ``benchmarks/checkpoint_integrity.py`` prints their table.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
from support.threads import ThreadGather

import lightning_nnscaler  # noqa: F401 - registers the strategies
from lightning_nnscaler import checkpoint, cli
from lightning_nnscaler.checkpoint import CheckpointError, layout, rank_file_name
from lightning_nnscaler.checkpoint.integrity import hash_bytes
from lightning_nnscaler.ir.box import PieceLocation
from lightning_nnscaler.strategy import checkpoint as strategy_checkpoint

WORLD_SIZE = 2


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(4, 6))
        self.bias = torch.nn.Parameter(torch.zeros(4))


class Killed(BaseException):
    """A simulated SIGKILL: nothing below it runs, no ``except Exception`` catches it."""


def _values(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(24.0).reshape(4, 6) * step + 0.5, torch.arange(4.0) * step


def save(path: Path, step: int, *, write: Optional[Callable[[int, Any, Path], Any]] = None, timeout: float = 10.0) -> list[Optional[BaseException]]:
    """``save_sharded`` of a tp-like 2-rank plan (rank r holds weight rows 2r..2r+1, rank 0 the bias) at ``step``,
    the ranks as threads; ``write(rank, payload, path)`` replaces the file write. Returns each rank's exception."""
    weight, bias = _values(step)
    gather = ThreadGather(WORLD_SIZE, timeout=timeout)
    errors: list[Optional[BaseException]] = [None] * WORLD_SIZE

    def rank_main(rank: int) -> None:
        gather.enter(rank)
        rows = PieceLocation("weight", ((2 * rank, 2 * rank + 2), (0, 6)))
        model = [(rows, weight[2 * rank: 2 * rank + 2])] + ([(PieceLocation("bias", ((0, 4),)), bias)] if rank == 0 else [])
        optimizer = [[(location, {"step": torch.tensor(float(step)), "exp_avg": value * 2}) for location, value in model]]
        groups = [{"lr": 0.1, "params": [0, 1]}]
        lightning_checkpoint = {"global_step": step, "epoch": step, "state_dict": {}, "pytorch-lightning_version": "2.6.6",
                                "optimizer_states": [{"state": {}, "param_groups": groups}]}
        try:
            strategy_checkpoint.save_sharded(
                lightning_checkpoint, path, rank=rank, world_size=WORLD_SIZE, module=Model(), model_pieces=model,
                optimizer_pieces=optimizer, group_keys=[[["weight", "bias"]]], plan={"recipe": "tp", "recipe_params": {}, "plan_hash": "0" * 64},
                gather=gather,
            )
        except CheckpointError as error:  # raised by every rank after the last collective
            errors[rank] = error
        except BaseException as error:  # noqa: BLE001 - a "killed" rank: the others must not wait for it
            errors[rank] = error
            gather.abort()

    original = strategy_checkpoint.write_atomically
    if write is not None:
        strategy_checkpoint.write_atomically = lambda payload, file: write(gather.local.rank, payload, file)
    try:
        threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(WORLD_SIZE)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        strategy_checkpoint.write_atomically = original
    return errors


def good(path: Path, step: int = 1) -> Path:
    """A good checkpoint at ``path`` of ``step``."""
    errors = save(path, step)
    assert errors == [None, None], errors
    return path


def current(path: Path) -> Path:
    return layout.current_save(path)[0]


def flip_bit_in_tensor(file: Path, tensor: torch.Tensor) -> None:
    data = bytearray(file.read_bytes())
    offset = bytes(data).find(tensor.contiguous().numpy().tobytes())
    assert offset > 0, "the tensor's bytes are in the file"
    data[offset + 5] ^= 0x10
    file.write_bytes(bytes(data))


def forge_metadata(path: Path, edit: Callable[[dict[str, Any]], None], rehash: tuple[str, ...] = ()) -> None:
    """Edit the metadata and re-record its hash in CURRENT (and the hashes of ``rehash`` files): a writer's bug, not damage."""
    directory = current(path)
    metadata = json.loads((directory / "metadata.json").read_text())
    edit(metadata)
    for name in rehash:
        data = (directory / name).read_bytes()
        metadata["files"][name] = {"size": len(data), "hash": hash_bytes(data)}
    text = json.dumps(metadata).encode()
    (directory / "metadata.json").write_bytes(text)
    pointer = json.loads((path / "CURRENT").read_text())
    (path / "CURRENT").write_text(json.dumps({**pointer, "metadata_size": len(text), "metadata_hash": hash_bytes(text)}))


# --- the cases: each damages a good checkpoint at `root / "epoch=1.ckpt"`; returns (path, expected message) ------------

def case_bit_flip_in_tensor_data(root: Path) -> tuple[Path, str]:
    path = good(root / "epoch=1.ckpt")
    flip_bit_in_tensor(current(path) / rank_file_name(1, 2), _values(1)[0][2:4])
    return path, r"rank00001-of-00002.pt has content hash .*; the metadata says .*corrupted"


def case_same_size_file_from_another_save(root: Path) -> tuple[Path, str]:
    older, path = good(root / "epoch=0.ckpt", step=1), good(root / "epoch=1.ckpt", step=2)
    source, target = current(older) / rank_file_name(1, 2), current(path) / rank_file_name(1, 2)
    assert source.stat().st_size == target.stat().st_size
    shutil.copyfile(source, target)
    return path, r"rank00001-of-00002.pt belongs to save '\w+' \(step 1\), not to this checkpoint's save '\w+' \(step 2\)"


def case_truncated_rank_file(root: Path) -> tuple[Path, str]:
    path = good(root / "epoch=1.ckpt")
    file = current(path) / rank_file_name(0, 2)
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    return path, r"rank00000-of-00002.pt is \d+ bytes; the metadata says \d+ bytes: the file was truncated"


def case_missing_rank_file(root: Path) -> tuple[Path, str]:
    path = good(root / "epoch=1.ckpt")
    (current(path) / rank_file_name(1, 2)).unlink()
    return path, r"rank00001-of-00002.pt is missing: the checkpoint lacks its rank 1's pieces"


def case_missing_metadata(root: Path) -> tuple[Path, str]:
    path = good(root / "epoch=1.ckpt")
    (current(path) / "metadata.json").unlink()
    return path, r"metadata.json is missing"


def case_non_json_metadata(root: Path) -> tuple[Path, str]:
    path = good(root / "epoch=1.ckpt")
    (current(path) / "metadata.json").write_bytes(b"\xff\xfe not json")
    return path, r"metadata.json is \d+ bytes; .*CURRENT says \d+ bytes"


def case_edited_metadata(root: Path) -> tuple[Path, str]:
    path = good(root / "epoch=1.ckpt")
    file = current(path) / "metadata.json"
    file.write_text(file.read_text().replace('"recipe": "tp"', '"recipe": "dp"'))
    return path, r"metadata.json has content hash .*; .*CURRENT says"


def case_resized_metadata(root: Path) -> tuple[Path, str]:
    path = good(root / "epoch=1.ckpt")
    file = current(path) / "metadata.json"
    file.write_text(file.read_text() + "\n")
    return path, r"metadata.json is \d+ bytes; .*CURRENT says \d+ bytes"


def case_missing_pointer(root: Path) -> tuple[Path, str]:
    path = good(root / "epoch=1.ckpt")
    (path / "CURRENT").unlink()
    return path, r"has no CURRENT: it is not a finished lightning-nnscaler checkpoint"


def case_corrupt_pointer(root: Path) -> tuple[Path, str]:
    path = good(root / "epoch=1.ckpt")
    (path / "CURRENT").write_bytes(b"{not json")
    return path, r"CURRENT is not valid JSON"


def case_wrong_world_size(root: Path) -> tuple[Path, str]:
    path = good(root / "epoch=1.ckpt")
    forge_metadata(path, lambda metadata: metadata.update(world_size=4))
    return path, r"lists no rank00000-of-00004.pt, .* which a save of world size 4 requires"


def case_wrong_shapes(root: Path) -> tuple[Path, str]:
    path = good(root / "epoch=1.ckpt")
    forge_metadata(path, lambda metadata: metadata["shapes"].update(weight=[3, 6]))
    return path, r"rank00001-of-00002.pt holds a piece \(\(2, 4\), \(0, 6\)\) of 'weight', outside its shape \[3, 6\]"


def case_corrupted_pickle_record(root: Path) -> tuple[Path, str]:
    path = good(root / "epoch=1.ckpt")
    file = current(path) / rank_file_name(1, 2)
    data = bytearray(file.read_bytes())
    offset = bytes(data).find(b"data.pkl") + 40  # inside the pickle record, after the zip entry's header
    data[offset: offset + 16] = b"\x00" * 16
    file.write_bytes(bytes(data))
    forge_metadata(path, lambda metadata: None, rehash=(rank_file_name(1, 2),))  # hashes pass: only the unpickler sees it
    return path, r"rank00001-of-00002.pt is not a readable torch checkpoint file"


def case_corrupted_common_file(root: Path) -> tuple[Path, str]:
    path = good(root / "epoch=1.ckpt")
    file = current(path) / "common.pt"
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))
    return path, r"common.pt has content hash .*corrupted"


def case_rank_file_not_shared(root: Path) -> tuple[Path, str]:
    """Rank 1 writes on "another machine": its file is not where rank 0 looks. The save fails on every rank."""
    path = good(root / "epoch=1.ckpt", step=1)
    elsewhere = root / "node1"
    errors = save(path, 2, write=lambda rank, payload, file: checkpoint.write_atomically(
        payload, file if rank == 0 else _mirror(elsewhere, file)))
    for error in errors:
        assert isinstance(error, CheckpointError) and "rank 0 cannot see the files that rank(s) 1 wrote" in str(error), errors
        assert "shared" in str(error)
    assert checkpoint.load(path)["global_step"] == 1  # the earlier checkpoint is kept
    (current(path) / rank_file_name(1, 2)).unlink()  # and a directory lacking a rank file, however made, is refused
    return path, r"rank00001-of-00002.pt is missing"


def _mirror(root: Path, file: Path) -> Path:
    target = root / file.parent.name / file.name
    target.parent.mkdir(parents=True, exist_ok=True)
    return target


def case_interrupted_first_save(root: Path) -> tuple[Path, str]:
    path = root / "epoch=1.ckpt"

    def die_on_rank_1(rank: int, payload: Any, file: Path) -> Any:
        if rank == 1:
            raise Killed
        return checkpoint.write_atomically(payload, file)

    save(path, 1, write=die_on_rank_1, timeout=2)
    return path, r"has no CURRENT: it is not a finished .*found \.partial-\w+"


def case_foreign_plain_file(root: Path) -> tuple[Path, str]:
    path = root / "notes.ckpt"
    path.write_text("not a checkpoint at all\n")
    return path, r"notes.ckpt is not a readable torch checkpoint file"


def case_torch_file_not_lightning(root: Path) -> tuple[Path, str]:
    path = root / "weights.pt"
    torch.save({"weight": torch.zeros(2)}, path)
    return path, r"weights.pt is a torch file but not a Lightning checkpoint"


def case_missing_path(root: Path) -> tuple[Path, str]:
    return root / "nowhere.ckpt", r"nowhere.ckpt does not exist"


CASES: dict[str, Callable[[Path], tuple[Path, str]]] = {
    name.removeprefix("case_").replace("_", " "): function for name, function in sorted(globals().items()) if name.startswith("case_")
}


def outcomes(path: Path, expected: str, output: Path) -> dict[str, str]:
    """How ``load``, ``ckpt info --verify`` and ``ckpt merge`` treat ``path``: "refused" (with the expected message),
    "refused (other message: ...)", or "SILENT" (accepted)."""
    results = {}
    for label, call in [("load", lambda: checkpoint.load(path)), ("info --verify", lambda: checkpoint.describe(path, verify=True)),
                        ("merge", lambda: checkpoint.merge(path, output))]:
        try:
            call()
            results[label] = "SILENT"
        except CheckpointError as error:
            results[label] = "refused" if re.search(expected, str(error)) and str(path.name) in str(error) else f"refused (other message: {error})"
    return results


@pytest.mark.parametrize("name", list(CASES))
def test_each_broken_checkpoint_is_refused_by_load_info_and_merge(name: str, tmp_path: Path) -> None:
    path, expected = CASES[name](tmp_path)
    assert outcomes(path, expected, tmp_path / "merged.ckpt") == {"load": "refused", "info --verify": "refused", "merge": "refused"}
    assert not (tmp_path / "merged.ckpt").exists()


@pytest.mark.parametrize("name", ["bit flip in tensor data", "missing rank file", "foreign plain file", "corrupt pointer"])
def test_the_cli_exits_2_with_one_line(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, expected = CASES[name](tmp_path)
    for argv in (["ckpt", "info", "--verify", str(path)], ["ckpt", "merge", str(path), str(tmp_path / "out.ckpt")]):
        assert cli.main(argv) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured.err
        assert "Traceback" not in captured.err and captured.err.startswith("lightning-nnscaler: ")


def test_a_good_checkpoint_loads_verifies_and_merges(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = good(tmp_path / "epoch=1.ckpt", step=3)
    loaded = checkpoint.load(path)
    torch.testing.assert_close(loaded["state_dict"]["weight"], _values(3)[0])
    assert loaded["optimizer_states"][0]["state"][1]["exp_avg"].equal(_values(3)[1] * 2)
    assert "lightning_nnscaler_save" not in loaded
    assert cli.main(["ckpt", "info", "--verify", str(path)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["verified"] and shown["leftovers"] == [] and shown["save"]["global_step"] == 3
    assert sorted(shown["files"]) == ["common.pt", "rank00000-of-00002.pt", "rank00001-of-00002.pt"]
    assert all(record["hash"].startswith(("xxh3_128:", "blake2b-128:")) for record in shown["files"].values())
    assert cli.main(["ckpt", "merge", str(path), str(tmp_path / "merged.ckpt")]) == 0
    capsys.readouterr()
    plain = tmp_path / "merged.ckpt"
    assert cli.main(["ckpt", "info", str(plain)]) == 0
    assert json.loads(capsys.readouterr().out)["kind"].startswith("plain Lightning checkpoint")
    assert cli.main(["ckpt", "merge", str(plain), str(tmp_path / "again.ckpt")]) == 2
    assert "already a plain Lightning checkpoint" in capsys.readouterr().err


def test_each_rank_file_carries_the_save_token_and_step(tmp_path: Path) -> None:
    path = good(tmp_path / "epoch=1.ckpt", step=4)
    token = checkpoint.read_metadata(path)["save"]["token"]
    for rank in range(WORLD_SIZE):
        record = torch.load(current(path) / rank_file_name(rank, 2), weights_only=True)["save"]
        assert (record["token"], record["rank"], record["world_size"], record["global_step"]) == (token, rank, 2, 4)


def test_commit_refuses_a_save_that_lacks_a_rank_file(tmp_path: Path) -> None:
    path = good(tmp_path / "epoch=1.ckpt", step=1)
    partial = checkpoint.partial_directory(path, "b")
    shutil.copytree(current(path), partial)
    (partial / "metadata.json").unlink()
    (partial / rank_file_name(1, 2)).unlink()
    with pytest.raises(CheckpointError, match="lacks rank00001-of-00002.pt"):
        checkpoint.commit(partial, path, {"world_size": 2})
    assert checkpoint.load(path)["global_step"] == 1


COMMIT_STEPS = ["commit started", "metadata written", "partial synced", "partial renamed", "directory synced", "pointer written",
                "pointer switched", "pointer synced", "earlier renamed", "earlier removed"]


@pytest.mark.parametrize("step", COMMIT_STEPS)
def test_an_overwrite_killed_at_any_commit_step_leaves_the_old_or_the_new_checkpoint(step: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = good(tmp_path / "last.ckpt", step=1)
    seen = []

    def kill_at(name: str) -> None:
        seen.append(name)
        if name == step:
            raise Killed

    monkeypatch.setattr(layout, "_after_step", kill_at)
    errors = save(path, 2, timeout=2)
    assert isinstance(errors[0], Killed) and step in seen
    monkeypatch.undo()
    expected = 2 if COMMIT_STEPS.index(step) >= COMMIT_STEPS.index("pointer switched") else 1
    assert checkpoint.describe(path, verify=True)["save"]["global_step"] == expected
    assert checkpoint.load(path)["global_step"] == expected
    left = checkpoint.describe(path)["leftovers"]
    if step != "earlier removed":
        assert left and all(name.startswith((".partial-", ".replaced-", "save-", ".CURRENT.tmp")) for name in left), left
    good(path, step=3)  # the next successful save removes the leftovers
    assert checkpoint.describe(path)["leftovers"] == [] and sorted(child.name for child in path.iterdir())[0] == "CURRENT"
    assert checkpoint.load(path)["global_step"] == 3


def test_every_rename_of_an_overwrite_keeps_the_path_loadable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kill before each ``os.replace`` of the commit too (the steps above are after each)."""
    path = good(tmp_path / "last.ckpt", step=1)
    replace = layout.os.replace
    for index in range(4):  # metadata, partial -> save, CURRENT, earlier -> .replaced
        calls = []

        def counting_replace(source: Any, target: Any, _index: int = index, _calls: list = calls) -> None:
            if Path(target).name in ("metadata.json", "CURRENT") or Path(target).name.startswith(("save-", ".replaced-")):
                _calls.append(target)  # the commit's renames, not the rank files' own
                if len(_calls) == _index + 1:
                    raise Killed
            replace(source, target)

        monkeypatch.setattr(layout.os, "replace", counting_replace)
        errors = save(path, 2 + index, timeout=2)
        monkeypatch.undo()
        assert isinstance(errors[0], Killed), errors
        assert checkpoint.load(path)["global_step"] in (1, 2 + index - 1, 2 + index)
        good(path, step=1)
