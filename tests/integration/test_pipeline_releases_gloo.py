"""A pipeline rank drops its copy of a sent message as soon as a later message from the peer proves it taken
(the generated ``RELEASES`` table, ``materialize.releases``): on real gloo ranks, what each rank of a 1F1B and an
interleaved plan (and of GPipe, whose
last stage sends every gradient after its last forward message came: no answer follows) still holds when the step waits for its sends is what the simulator says it holds then."""

from __future__ import annotations

import pytest
import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.codegen import module_from_source
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.runtime import TorchDistributedCommunicator
from lightning_nnscaler.runtime.executor import RankExecutor
from lightning_nnscaler.sim import predict
from support.ranks import launch_ranks

CONFIG = GPTConfig(vocab_size=128, seq_len=16, hidden=32, layers=4, heads=2)


class HeldAtStepEnd(TorchDistributedCommunicator):
    """Records how many sends the rank still holds each time the step waits for them."""

    def __init__(self, timeout: float) -> None:
        super().__init__(timeout)
        self.held: list[int] = []

    def wait_sends(self) -> None:
        self.held.append(self.sends_in_flight)
        super().wait_sends()


def model_and_batch() -> tuple[GPT, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    model.log = lambda *args, **kwargs: None
    return model, model.example_batch(8, torch.Generator().manual_seed(0))


def held_at_step_end(rank: int, world_size: int, sources: list[str], offsets: list[dict[str, int]]) -> int:
    """Sends the rank still holds when its second step waits for them."""
    torch.set_num_threads(1)
    model, batch = model_and_batch()
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    communicator = HeldAtStepEnd(60.0)
    executor = RankExecutor(module_from_source(sources[rank], f"released_rank{rank}"), rank, state, {}, communicator,
                            input_offsets=offsets[rank])
    inputs = dict(zip([f"batch_{index}" for index in range(len(batch))], batch))
    for _ in range(2):
        executor.forward_backward(inputs)
    return communicator.held[-1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("recipe", "held"), [("1f1b", [0, 2]), ("interleaved", [0, 2]), ("gpipe", [0, 4])])
def test_each_rank_holds_only_the_messages_no_later_one_answered(recipe: str, held: list[int]) -> None:
    model, batch = model_and_batch()
    plan = lnn.parallelize(model, batch, recipe, 2, step="training_step", stages=2, microbatches=4)
    assert "RELEASES = {" in plan.sources[1]
    measured = launch_ranks(held_at_step_end, 2, plan.sources, [plan.input_offsets(rank) for rank in range(2)], timeout=90.0)
    assert measured == held  # without the table, rank 1 held every gradient it sent back
    simulated = predict(plan, "cpu").simulation.ranks
    message = 8 // 4 * CONFIG.seq_len * CONFIG.hidden * 4  # one microbatch's boundary activation (or its gradient)
    assert [stats.sent_bytes for stats in simulated] == [count * message for count in held]
