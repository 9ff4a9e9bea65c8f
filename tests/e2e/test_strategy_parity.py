"""Trainer(strategy=nnscaler) trains the GPT reference exactly like Trainer(strategy="ddp") on 2 gloo ranks.

One process group (started as torchrun would) runs every Trainer in turn: DDP, then nnscaler with
dp and tp, and with tp and zero3 under gradient accumulation and norm clipping, all with two param
groups and a warm-up LR schedule. Per-step losses, the logged losses, the validation loss after
training and the final weights must agree with DDP's; with precision="bf16-mixed", the losses
must stay within bf16's tolerance of DDP's 32-true ones.

Checkpoints: zero3 and DDP each save one per epoch (3 steps); runs resumed from zero3's under tp,
and under DDP (the checkpoint is a plain Lightning checkpoint), must match DDP resumed from its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_nnscaler.runtime.launch import launch

from lightning_runs import GLOBAL_BATCH, STEPS, parity_worker  # noqa: E402 - tests/e2e is on sys.path

# gradient_clip_val 0.5: the global gradient norm of these batches is about 1.4, so every step clips.
ACCUMULATE_AND_CLIP = {"accumulate": 2, "clip": 0.5}
EPOCHS_OF_3 = {"steps": 6, "samples": 3 * GLOBAL_BATCH}  # a checkpoint at the end of each 3-step epoch
REFERENCE = {
    "dp": "ddp",
    "tp": "ddp",
    "tp accumulate+clip": "ddp accumulate+clip",
    "zero3 accumulate+clip": "ddp accumulate+clip",
    "zero3 saving": "ddp saving",
    "tp resumed from zero3's": "ddp resumed from its own",
    "ddp resumed from zero3's": "ddp resumed from its own",
}


def parity_runs(checkpoints: Path) -> list[tuple[str, str, dict]]:
    """(label, strategy, fit_gpt options) of every run, in order."""
    first_epoch = "epoch=0-step=3.ckpt"
    return [
        ("ddp", "ddp", {}),
        ("dp", "nnscaler", {}),
        ("tp", "nnscaler_tp", {}),
        ("ddp accumulate+clip", "ddp", ACCUMULATE_AND_CLIP),
        ("tp accumulate+clip", "nnscaler_tp", ACCUMULATE_AND_CLIP),
        ("zero3 accumulate+clip", "nnscaler_zero3", ACCUMULATE_AND_CLIP),
        ("tp bf16-mixed", "nnscaler_tp", {"precision": "bf16-mixed"}),
        ("ddp saving", "ddp", {**EPOCHS_OF_3, "checkpoint_dir": str(checkpoints / "ddp")}),
        ("zero3 saving", "nnscaler_zero3", {**EPOCHS_OF_3, "checkpoint_dir": str(checkpoints / "zero3")}),
        ("ddp resumed from its own", "ddp", {**EPOCHS_OF_3, "resume_from": str(checkpoints / "ddp" / first_epoch)}),
        ("tp resumed from zero3's", "nnscaler_tp", {**EPOCHS_OF_3, "resume_from": str(checkpoints / "zero3" / first_epoch)}),
        ("ddp resumed from zero3's", "ddp", {**EPOCHS_OF_3, "resume_from": str(checkpoints / "zero3" / first_epoch)}),
    ]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def results(checkpoints: Path) -> list[dict]:
    return launch(parity_worker, 2, parity_runs(checkpoints), timeout=280)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("label", list(REFERENCE))
def test_nnscaler_trains_like_ddp(results: list[dict], label: str) -> None:
    expected = results[0][REFERENCE[label]]
    for rank, by_label in enumerate(results):
        actual = by_label[label]
        assert len(actual["losses"]) == len(expected["losses"]) >= STEPS - 2
        torch.testing.assert_close(torch.tensor(actual["losses"]), torch.tensor(expected["losses"]), rtol=1e-5, atol=1e-6, msg=lambda m, r=rank: f"{label} rank {r} losses: {m}")
        assert actual["learning_rates"] == expected["learning_rates"], f"{label} rank {rank}: the LR schedule differs"
        assert actual["train_loss"] == pytest.approx(expected["train_loss"], rel=1e-5), f"{label} rank {rank}: logged train_loss"
        assert actual["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-5), f"{label} rank {rank}: val_loss after training"
        assert actual["state"].keys() == expected["state"].keys()
        for key, value in expected["state"].items():
            # atol 1e-5: a key projection's bias has an exactly-zero true gradient (softmax ignores a
            # shift), so its AdamW updates are normalized rounding noise of order lr * 1e-3.
            torch.testing.assert_close(actual["state"][key], value, rtol=1e-5, atol=1e-5, msg=lambda m, k=key, r=rank: f"{label} rank {r} {k}: {m}")


@pytest.mark.timeout(300)
def test_bf16_mixed_stays_within_bf16_tolerance_of_32_true(results: list[dict]) -> None:
    expected = results[0]["ddp"]["losses"]
    for rank, by_label in enumerate(results):
        # bf16 keeps 8 significant bits: a relative error of 2**-8 per rounding, far less on a mean loss.
        torch.testing.assert_close(torch.tensor(by_label["tp bf16-mixed"]["losses"]), torch.tensor(expected), rtol=1e-2, atol=0.0, msg=lambda m, r=rank: f"rank {r}: {m}")


@pytest.mark.timeout(300)
def test_checkpoint_is_a_plain_lightning_checkpoint(results: list[dict], checkpoints: Path) -> None:
    ours = torch.load(checkpoints / "zero3" / "epoch=0-step=3.ckpt", weights_only=True)
    ddp = torch.load(checkpoints / "ddp" / "epoch=0-step=3.ckpt", weights_only=True)
    assert ours.keys() == ddp.keys()
    assert ours["optimizer_states"][0]["param_groups"] == ddp["optimizer_states"][0]["param_groups"]
    ours_state, ddp_state = ours["optimizer_states"][0]["state"], ddp["optimizer_states"][0]["state"]
    assert ours_state.keys() == ddp_state.keys()
    for index, entries in ddp_state.items():
        for name, value in entries.items():
            torch.testing.assert_close(ours_state[index][name], value, rtol=1e-5, atol=1e-6, msg=lambda m, i=index, n=name: f"parameter {i} {n}: {m}")
    for key, value in ddp["state_dict"].items():
        torch.testing.assert_close(ours["state_dict"][key], value, rtol=1e-5, atol=1e-5)
