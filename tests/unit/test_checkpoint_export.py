"""``ckpt merge --format safetensors``: a sharded checkpoint's weights streamed tensor by tensor into a Hugging Face
safetensors directory (checkpoint/export.py), read back by safetensors and by ``transformers``' ``from_pretrained``.

The checkpoints are saved by the strategy's own writer (``strategy.checkpoint.save_sharded``) at 2 ranks run as
threads in this process: every tensor of two or more rows is split by rows between the ranks."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Callable

import lightning
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch.profiler import ProfilerActivity, profile

from lightning_nnscaler import checkpoint
from lightning_nnscaler.checkpoint import CheckpointError
from lightning_nnscaler.cli import main
from lightning_nnscaler.ir.box import PieceLocation
from lightning_nnscaler.strategy.checkpoint import save_sharded


def _gathers(world_size: int) -> list[Callable[[Any], list[Any]]]:
    """An all-gather for each of ``world_size`` threads."""
    barrier, slots = threading.Barrier(world_size, timeout=30), [None] * world_size

    def gather_of(rank: int) -> Callable[[Any], list[Any]]:
        def gather(value: Any) -> list[Any]:
            slots[rank] = value
            barrier.wait()
            gathered = list(slots)
            barrier.wait()
            return gathered
        return gather
    return [gather_of(rank) for rank in range(world_size)]


def save_at_two_ranks(module: torch.nn.Module, path: Path) -> None:
    """Save ``module`` as a sharded checkpoint of 2 ranks: rows split between them; the rest (tied keys, 1-row and
    0-dim tensors) written whole by rank 0, as the strategy writes state the plan does not hold."""
    pieces: list[list[tuple[PieceLocation, torch.Tensor]]] = [[], []]
    for key, value in module.state_dict(keep_vars=True).items():
        if value.dim() and value.shape[0] >= 2 and key in dict(module.named_parameters()):
            middle = value.shape[0] // 2
            for rank, (start, stop) in enumerate(((0, middle), (middle, value.shape[0]))):
                box = ((start, stop), *((0, size) for size in value.shape[1:]))
                pieces[rank].append((PieceLocation(key, box), value.detach()[start:stop].clone()))
    common = {"global_step": 3, "epoch": 0, "pytorch-lightning_version": lightning.__version__}
    plan = {"recipe": "tp", "recipe_params": {}, "plan_hash": "0" * 64}
    errors: list[BaseException] = []

    def rank_main(rank: int, gather: Callable[[Any], list[Any]]) -> None:
        try:
            save_sharded(dict(common), path, rank=rank, world_size=2, module=module, model_pieces=pieces[rank], optimizer_pieces=[],
                         group_keys=[], plan=plan, gather=gather)
        except BaseException as error:  # noqa: BLE001 - reported by the test's thread
            errors.append(error)
    threads = [threading.Thread(target=rank_main, args=(rank, gather)) for rank, gather in enumerate(_gathers(2))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors


class Layers(torch.nn.Module):
    def __init__(self, sizes: list[tuple[int, ...]], dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.weights = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(size, generator=generator).to(dtype)) for size in sizes])
        self.register_buffer("steps", torch.tensor(7, dtype=torch.int64))


def _exported(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(file))
    return tensors


def test_export_splits_into_shards_with_an_index_and_equals_the_single_device_state(tmp_path: Path) -> None:
    module = Layers([(8, 4), (6,), (16, 4), (1, 3), (5, 2, 2)], dtype=torch.bfloat16)
    save_at_two_ranks(module, tmp_path / "epoch=0.ckpt")
    expected = checkpoint.load(tmp_path / "epoch=0.ckpt")["state_dict"]
    out = tmp_path / "hf"
    assert main(["ckpt", "merge", "--format", "safetensors", "--max-shard-size", "100", str(tmp_path / "epoch=0.ckpt"), str(out)]) == 0

    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(path.name for path in out.glob("*.safetensors"))
    assert len(shards) >= 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert list(index["weight_map"]) == list(expected) and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(value.numel() * value.element_size() for value in expected.values())
    exported = _exported(out)
    assert list(exported) != [] and set(exported) == set(expected)
    for key, value in expected.items():
        assert exported[key].dtype == value.dtype and torch.equal(exported[key], value), key
    with safe_open(out / index["weight_map"]["weights.2"], framework="pt") as opened:
        torch.testing.assert_close(opened.get_slice("weights.2")[4:12], expected["weights.2"][4:12], rtol=0, atol=0)
    assert [path.name for path in tmp_path.iterdir() if path.name.startswith(".")] == []  # the temporary directory is gone


def test_export_refuses_an_existing_directory_that_is_not_empty_and_a_prefix_not_every_key_has(tmp_path: Path) -> None:
    save_at_two_ranks(Layers([(4, 2)]), tmp_path / "a.ckpt")
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"occupied exists and is not empty \(it holds notes.txt\)"):
        checkpoint.export_safetensors(tmp_path / "a.ckpt", occupied)
    assert main(["ckpt", "merge", "--format", "safetensors", str(tmp_path / "a.ckpt"), str(occupied)]) == 2  # one line, status 2
    assert main(["ckpt", "merge", "--format", "safetensors", "--max-shard-size", "5 parsecs", str(tmp_path / "a.ckpt"), str(tmp_path / "x")]) == 2
    assert [path.name for path in occupied.iterdir()] == ["notes.txt"]
    with pytest.raises(CheckpointError, match=r"--strip-prefix 'model.': 2 key\(s\) do not start with it"):
        checkpoint.export_safetensors(tmp_path / "a.ckpt", tmp_path / "out", strip_prefix="model.")
    assert not (tmp_path / "out").exists()
    (tmp_path / "empty").mkdir()
    assert checkpoint.export_safetensors(tmp_path / "a.ckpt", tmp_path / "empty") == ["model.safetensors"]  # an empty one is fine
    assert sorted(load_file(tmp_path / "empty" / "model.safetensors")) == ["steps", "weights.0"]


def _peak_allocated(function: Callable[[], Any]) -> int:
    """The peak of the CPU tensor storage bytes live while ``function`` runs, above its start: torch.profiler's memory
    events summed in time order. Deterministic (it counts allocations, not RSS), so robust on a loaded machine.
    ``torch.load(mmap=True)`` reports each mapped rank file as one storage of the file's size: file-backed pages the
    kernel can drop, which the caller subtracts."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        function()
    live = peak = 0
    for event in sorted((event for event in profiler.events() if event.self_cpu_memory_usage), key=lambda event: event.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def test_export_holds_about_one_tensor_at_a_time(tmp_path: Path) -> None:
    sizes = [(256, 256)] * 12 + [(512, 256)]  # 12 x 256 KiB and the largest, 512 KiB: 3.5 MiB in all
    save_at_two_ranks(Layers(sizes), tmp_path / "big.ckpt")
    largest, total = 512 * 256 * 4, sum(rows * columns * 4 for rows, columns in sizes)
    mapped = sum(file.stat().st_size for file in (tmp_path / "big.ckpt").glob("save-*/rank*.pt"))
    streamed = _peak_allocated(lambda: checkpoint.export_safetensors(tmp_path / "big.ckpt", tmp_path / "hf", max_shard_size="1MB")) - mapped
    assembled = _peak_allocated(lambda: checkpoint.load(tmp_path / "big.ckpt")) - mapped
    print(f"peak allocated beside the mapped files: export {streamed / 2**20:.2f} MiB, load {assembled / 2**20:.2f} MiB; "
          f"largest tensor {largest / 2**20:.2f} MiB, total {total / 2**20:.2f} MiB")
    assert largest <= streamed < 2 * largest  # the tensor and its coverage mask (1 byte an element)
    assert assembled >= total  # the counter sees what a full assembly holds
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) >= 4


def test_transformers_from_pretrained_reads_the_export(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)

    class Wrapper(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = transformers.GPT2LMHeadModel(config)

    wrapper = Wrapper()
    save_at_two_ranks(wrapper, tmp_path / "gpt.ckpt")
    out = tmp_path / "gpt2"
    assert main(["ckpt", "merge", str(tmp_path / "gpt.ckpt"), str(out), "--format", "safetensors", "--strip-prefix", "model.",
                 "--max-shard-size", "40KB"]) == 0
    assert (out / "model.safetensors.index.json").exists()
    config.save_pretrained(out)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out, local_files_only=True)
    expected = wrapper.model.state_dict()
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, expected[key]), key
    tokens = torch.randint(0, 64, (1, 8))
    torch.testing.assert_close(loaded.eval()(tokens).logits, wrapper.model.eval()(tokens).logits)
