"""Pretrained weights per slice: ``NnScalerStrategy(recipe, pretrained=...)`` at 4 gloo ranks under tp.

A module built on meta takes its pieces from the safetensors file instead of its recorded initialization, each rank
reading only its own pieces' slices; an eager module's values are replaced by the file's. The first validation loss
and the state gathered after a fit (learning rate 0) equal the eager module's after ``load_state_dict`` (rtol 1e-5).
A key missing from the file, or stored with another shape, is refused by name.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from support.ranks import launch_ranks

import lightning_nnscaler as lnn  # noqa: E402
from lightning_nnscaler.checkpoint.integrity import CheckpointError  # noqa: E402
from lightning_nnscaler.checkpoint.pretrained import PretrainedWeights  # noqa: E402
from lightning_nnscaler.ir.box import PieceLocation  # noqa: E402
from pretrained_runs import CONFIG, FrozenGPT, pretrained_worker, token_loader  # noqa: E402

RUNS = [("tp-meta", "tp", "meta"), ("tp-eager", "tp", "eager")]
WORLD_SIZE = 4


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A safetensors file of a GPT's state (seed 5) and that state."""
    torch.manual_seed(5)
    state = FrozenGPT(CONFIG).state_dict()
    path = tmp_path_factory.mktemp("pretrained") / "model.safetensors"
    save_file(state, str(path))
    return path, state


@pytest.fixture(scope="module")
def results(pretrained: tuple[Path, dict[str, torch.Tensor]]) -> list[dict[str, Any]]:
    """Every rank's results of every run."""
    return launch_ranks(pretrained_worker, WORLD_SIZE, RUNS, str(pretrained[0]), timeout=600)


def eager_validation_loss(state: dict[str, torch.Tensor]) -> float:
    """The mean validation loss of ``state`` loaded into the eager module with ``load_state_dict``."""
    model = FrozenGPT(CONFIG)
    model.load_state_dict(state)
    with torch.no_grad():
        return float(torch.stack([model.compute_loss(batch) for batch in token_loader(seed=2)]).mean())


@pytest.mark.timeout(660)
@pytest.mark.parametrize("name", [name for name, _, _ in RUNS])
def test_pretrained_weights_give_the_eager_modules_values(
    results: list[dict[str, Any]], pretrained: tuple[Path, dict[str, torch.Tensor]], name: str
) -> None:
    ours = results[0][name]
    path, state = pretrained
    assert ours["val_loss"] == pytest.approx(eager_validation_loss(state), rel=1e-5)
    assert set(ours["state"]) == set(state)
    for key, value in state.items():
        torch.testing.assert_close(ours["state"][key], value, rtol=1e-5, atol=0, msg=lambda m, k=key: f"{k}: {m}")
    assert ours["on_meta"] == (name == "tp-meta")


@pytest.mark.timeout(660)
def test_each_rank_reads_only_its_slices_of_the_file(
    results: list[dict[str, Any]], pretrained: tuple[Path, dict[str, torch.Tensor]]
) -> None:
    path, state = pretrained
    total = sum(tensor.numel() * tensor.element_size() for tensor in state.values())
    shares = [(by_run["tp-meta"]["bytes_validate"] / total, by_run["tp-meta"]["bytes_fit"] / total) for by_run in results]
    print(f"bytes read per rank / the file's {total} B (validate, fit): {shares}")
    for validate, fit in shares:
        assert 1 / WORLD_SIZE <= validate <= 0.3 and fit == validate  # its quarter of the split tensors, plus the whole ones
    assert all(by_run["tp-eager"]["bytes_validate"] == total for by_run in results)  # an eager module is filled whole


def test_a_box_of_columns_is_read_alone_and_contiguous(tmp_path: Path) -> None:
    weight = torch.randn(64, 256)
    save_file({"weight": weight}, str(tmp_path / "model.safetensors"))
    weights = PretrainedWeights(tmp_path, {"weight": (64, 256)})
    columns = weights.read_piece(PieceLocation("weight", ((0, 64), (64, 128))))
    torch.testing.assert_close(columns, weight[:, 64:128], rtol=0, atol=0)
    assert columns.is_contiguous() and columns.untyped_storage().nbytes() == weight.nbytes // 4  # its own elements only
    chunk = weights.read_piece(PieceLocation("weight", ((0, 64), (64, 128)), chunk=(1, 1000)))  # ZeRO: a flat chunk of the box
    torch.testing.assert_close(chunk, columns.reshape(-1)[1000:2000], rtol=0, atol=0)
    assert weights.bytes_read == 2 * weight.nbytes // 4


def test_a_key_missing_or_of_another_shape_is_refused_by_name(pretrained: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    path, state = pretrained
    wider = FrozenGPT(dataclasses.replace(CONFIG, ffn_hidden=256))
    with pytest.raises(CheckpointError, match=r"'blocks\.0\.mlp\..*' has shape \[\d+, \d+\] in the pretrained weights .* the module's is"):
        PretrainedWeights.of_module(path, wider)
    partial = tmp_path / "partial.safetensors"
    save_file({key: value for key, value in state.items() if key != "ln_f.weight"}, str(partial))
    with pytest.raises(CheckpointError, match=r"'ln_f\.weight' \(shape \[128\]\) is not in the pretrained weights"):
        PretrainedWeights.of_module(partial, FrozenGPT(CONFIG))
    with pytest.raises(CheckpointError, match="does not exist"):
        lnn.NnScalerStrategy("tp", pretrained=tmp_path / "missing.safetensors")
