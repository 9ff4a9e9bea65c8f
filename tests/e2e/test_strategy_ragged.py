"""Batches of varying shape train as under ddp: a ragged last batch (``drop_last=False``) and
sequence lengths that change between batches get a plan each, over the same parameter pieces; what
``training_step`` logs reaches the loggers as under ddp."""

from __future__ import annotations

import pytest
import torch

from support.ranks import launch_ranks

from lightning_runs import TokenDataset, build_model  # noqa: E402 - tests/e2e is on sys.path
from ragged_runs import REPLICA_BATCH, SAMPLES, ragged_worker  # noqa: E402

RUNS = [
    ("ddp", "fixed"), ("nnscaler", "fixed"), ("nnscaler_tp", "fixed"), ("nnscaler_tp", "varying"),
    ("ddp", "metrics"), ("nnscaler", "metrics"),
]


@pytest.fixture(scope="module")
def results() -> list[dict[str, dict]]:
    return launch_ranks(ragged_worker, 2, RUNS, timeout=280)


def single_device_losses(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """The losses a one-device loop over ``batches`` computes, with the model's optimizer and LR schedule."""
    model = build_model()
    configured = model.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    losses = []
    for batch in batches:
        loss = model.compute_loss(batch)
        losses.append(float(loss.detach()))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
    return losses


def recorded_batches(recorded: list[list[list[int]]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (tokens, targets) batches a run recorded (its tokens), looked up in the dataset."""
    dataset = TokenDataset(SAMPLES, seed=1)
    batches = []
    for rows in recorded:
        tokens = torch.tensor(rows)  # (B, T)
        length = tokens.shape[1]
        index = [next(i for i in range(SAMPLES) if dataset.tokens[i, :length].tolist() == row) for row in rows]
        batches.append((tokens, dataset.targets[index, :length]))
    return batches


@pytest.mark.timeout(300)
def test_data_parallel_trains_a_ragged_last_batch_as_ddp(results) -> None:
    for rank in (0, 1):
        ddp, ours = results[rank]["ddp"], results[rank]["nnscaler"]
        assert [len(batch) for batch in ddp["batches"]] == [2, 2, 2, 1]  # the sampler pads 13 samples to 7 per replica
        assert ours["batches"] == ddp["batches"]
        assert ours["steps"] == ddp["steps"] == 4
        assert ours["plans"] == 2  # the full batches' and the ragged last one's
        torch.testing.assert_close(torch.tensor(ours["logged"]), torch.tensor(ddp["logged"]), rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(300)
def test_tensor_parallel_trains_a_ragged_last_batch_as_one_device(results) -> None:
    rank0, rank1 = results[0]["nnscaler_tp"], results[1]["nnscaler_tp"]
    assert rank0["batches"] == rank1["batches"] and rank0["logged"] == rank1["logged"]
    assert rank0["steps"] == 7 and [len(batch) for batch in rank0["batches"]][-1] == 1
    assert rank0["plans"] == 2
    reference = single_device_losses(recorded_batches(rank0["batches"]))
    torch.testing.assert_close(torch.tensor(rank0["logged"]), torch.tensor(reference), rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(300)
def test_tensor_parallel_trains_varying_sequence_lengths(results) -> None:
    ours = results[0]["nnscaler_tp_varying"]
    shapes = {(len(batch), len(batch[0])) for batch in ours["batches"]}
    assert len(shapes) > 2  # lengths vary, and the last batch is ragged too
    assert ours["steps"] == -(-SAMPLES // REPLICA_BATCH) and ours["plans"] == len(shapes)
    batches = recorded_batches(ours["batches"])
    torch.testing.assert_close(torch.tensor(ours["logged"]), torch.tensor(single_device_losses(batches)), rtol=1e-5, atol=1e-6)


def test_a_new_shape_is_refused_when_ranks_disagree_or_too_many_shapes_were_planned() -> None:
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from lightning_nnscaler.strategy.planning import MAX_PLANS, check_new_signature

    signature = ((2, 16), (2, 16))
    check_new_signature(signature, [], lambda value: [value, value])
    with pytest.raises(MisconfigurationException, match=r"batches of different shapes at the same step.*pad variable-length"):
        check_new_signature(signature, [], lambda value: [value, ((2, 12), (2, 12))])
    known = [((2, length), (2, length)) for length in range(1, MAX_PLANS + 1)]
    with pytest.raises(MisconfigurationException, match=rf"at most {MAX_PLANS} batch shapes per fit.*Pad variable-length inputs"):
        check_new_signature(signature, known, lambda value: [value])


@pytest.mark.timeout(300)
def test_logged_metrics_reach_the_csv_as_under_ddp(results) -> None:
    ddp, ours = results[0]["ddp_metrics"]["rows"], results[0]["nnscaler_metrics"]["rows"]
    assert len(ours) == len(ddp) == 5  # 4 steps (the last one ragged) and the epoch row
    columns = set(ddp[0])
    assert {"train_loss", "train_acc_step", "train_acc_epoch", "perplexity", "replica_loss"} <= columns == set(ours[0])
    for ddp_row, our_row in zip(ddp, ours):
        for column in sorted(columns):
            if ddp_row[column] == "":
                assert our_row[column] == "", f"{column}: logged under nnscaler only"
                continue
            assert float(our_row[column]) == pytest.approx(float(ddp_row[column]), rel=1e-5), f"step {ddp_row['step']}: {column}"
    losses = [float(row["replica_loss"]) for row in ddp if row["replica_loss"]]
    synced = [float(row["train_loss"]) for row in ddp if row["train_loss"]]
    assert losses != pytest.approx(synced, rel=1e-5)  # replica_loss is rank 0's own, not the synced mean: both kinds checked
