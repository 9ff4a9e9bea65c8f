"""Memory in flight (``sim.transient``): the backward's gradients, both engines' peaks, and a one-rank plan's
predicted peak against the allocator's (``sim.meter.AllocationMeter``) while its generated code runs."""

from __future__ import annotations

import pytest
import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.codegen import module_from_source
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.runtime.executor import RankExecutor
from lightning_nnscaler.runtime.memory_comm import InMemoryCommunicator, InMemoryWorld
from lightning_nnscaler.sim import CommModel, Machine, load_spec, predict, simulate
from lightning_nnscaler.sim.meter import AllocationMeter
from lightning_nnscaler.sim.tasks import Compute, Recv, Send
from lightning_nnscaler.sim.transient import OpMemory, backward_peaks


def test_a_gradient_lives_from_its_consumers_backward_to_its_producers() -> None:
    # forward: a = f(x); b = g(a); loss = h(b); g keeps 10 bytes, h keeps 4
    f = OpMemory(0, (("x", 100, False, False),), ("a",))  # x is a leaf activation here: its gradient stays
    g = OpMemory(10, (("a", 100, False, False), ("w", 50, True, False)), ("b",))
    h = OpMemory(4, (("b", 100, False, False),), ("loss",), internal=30, fed=True)
    # backward: h makes grad b (100) and its internal gradient (30); g makes grad a (100) while grad b lives,
    # and w's gradient (50) until it is added to .grad, with h's 4 kept bytes freed; f frees grad a
    assert backward_peaks([[f, g, h]]) == [100 + 100 + 50 - 4]
    # split in two chunks: the gradient of the second chunk's input carries into the first
    assert backward_peaks([[f], [g, h]]) == [100 + 100, 100 + 100 + 50 - 4]


def test_a_view_makes_no_new_gradient() -> None:
    view = OpMemory(0, (("a", 100, False, True),), ("v",))
    use = OpMemory(0, (("v", 100, False, False),), ("out",), fed=True)
    assert backward_peaks([[view, use]]) == [100]


def test_an_op_no_gradient_reaches_makes_none() -> None:
    # a replica's copy of the loss: another rank seeds backward, so nothing flows back through it here
    loss = OpMemory(8, (("logits", 400, False, False),), ("loss",))
    head = OpMemory(0, (("hidden", 100, False, False), ("w", 50, True, False)), ("logits",))
    assert backward_peaks([[head, loss]]) == [0]
    assert backward_peaks([[head, OpMemory(8, (("logits", 400, False, False),), ("loss",), fed=True)]]) == [400 + 100 + 50 - 8]


@pytest.mark.parametrize("cores", [None, 10**6], ids=["list engine", "event engine"])
def test_both_engines_count_what_a_task_holds_while_it_runs(cores: int | None) -> None:
    tasks = [Compute(1.0, "forward", activation_bytes=100, transient_bytes=130), Compute(1.0, "backward", activation_bytes=-100, transient_bytes=140)]
    result = simulate([tasks], CommModel(load_spec("a100")), Machine(ranks_per_node=8, cores_per_node=cores))
    assert result.ranks[0].peak_activation_bytes == 100  # kept for backward
    assert result.ranks[0].peak_live_bytes == 100 + 140  # the backward's gradients on top of the kept bytes


@pytest.mark.parametrize("cores", [None, 10**6], ids=["list engine", "event engine"])
def test_parameter_gradients_a_backward_makes_live_on_after_it(cores: int | None) -> None:
    tasks = [Compute(1.0, "forward", activation_bytes=100, transient_bytes=100),
             Compute(1.0, "backward", activation_bytes=-100, transient_bytes=140, gradient_bytes=50),  # a pipeline's first B
             Compute(1.0, "forward", activation_bytes=300, transient_bytes=300)]  # the next microbatch's F
    stats = simulate([tasks], CommModel(load_spec("a100")), Machine(ranks_per_node=8, cores_per_node=cores)).ranks[0]
    assert (stats.peak_live_bytes, stats.gradient_bytes, stats.gradients_at_peak) == (50 + 300, 50, 50)


@pytest.mark.parametrize("cores", [None, 10**6], ids=["list engine", "event engine"])
def test_a_senders_copies_of_its_messages_count_until_the_steps_end(cores: int | None) -> None:
    sender = [Compute(1.0, "forward", activation_bytes=100), Send(1, 30), Send(1, 40),
              Compute(1.0, "backward", activation_bytes=-100, transient_bytes=20)]
    receiver = [Recv(0), Recv(0), Compute(1.0, "forward", activation_bytes=10)]
    ranks = simulate([sender, receiver], CommModel(load_spec("a100")), Machine(ranks_per_node=8, cores_per_node=cores)).ranks
    assert (ranks[0].sent_bytes, ranks[0].peak_live_bytes, ranks[0].peak_activation_bytes) == (70, 100 + 70 + 20, 100)
    assert (ranks[1].sent_bytes, ranks[1].peak_live_bytes) == (0, 10)  # what a rank received is an activation of its own


def test_co_shard_slices_of_a_parameter_make_its_whole_gradient_once() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, seq_len=16, hidden=64, layers=1, heads=4))
    model.log = lambda *args, **kwargs: None
    batch = model.example_batch(4, torch.Generator().manual_seed(0))
    stats = predict(lnn.parallelize(model, batch, "coshard", 2, step="training_step", shards=2), "cpu").simulation.ranks[0]
    sizes = {name: parameter.numel() * 4 for name, parameter in model.named_parameters()}
    halves = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj.weight", "mlp.fc1", "mlp.fc2.weight")
    wholes = ("attn.out_proj.bias", "mlp.fc2.bias")  # rank 0 adds the output biases to its partial sums
    expected = sum(size // 2 for name, size in sizes.items() if any(key in name for key in halves))
    expected += sum(size for name, size in sizes.items() if any(key in name for key in wholes))
    assert stats.gradient_bytes == expected  # each piece's gradient once: not zero, not one per co-shard


def allocated_in_a_step(plan: lnn.Plan) -> int:
    """Bytes the allocator hands out beyond what is held, over one forward + backward of ``plan``'s code (one rank)."""
    state = {**dict(plan.module.named_parameters()), **dict(plan.module.named_buffers())}

    communicator = InMemoryCommunicator(InMemoryWorld(1, 60.0), 0)  # on this thread: the profiler meters the thread it starts on
    executor = RankExecutor(module_from_source(plan.sources[0], "allocated_rank0"), 0, state, plan.graph.constant_values, communicator,
                            input_offsets=plan.input_offsets(0))
    inputs = plan.replica_inputs(0, plan.inputs())
    executor.forward_backward(inputs)
    for parameter in executor.parameters():
        parameter.grad = None  # as zero_grad(set_to_none=True): the step allocates them
    with AllocationMeter() as meter:
        executor.forward_backward(inputs)
    return meter.peak


@pytest.mark.timeout(120)
def test_a_one_rank_plans_predicted_peak_is_what_the_allocator_hands_out() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=2048, seq_len=64, hidden=64, layers=2, heads=4))  # logits outweigh a layer's activations
    model.log = lambda *args, **kwargs: None
    plan = lnn.parallelize(model, model.example_batch(8, torch.Generator().manual_seed(0)), "dp", 1, step="training_step")
    row = predict(plan, "cpu").memory[0]
    predicted = row["activations"] + row["transient"] + row["gradients"]
    measured = allocated_in_a_step(plan)
    assert abs(predicted / measured - 1) <= 0.10, f"predicted {predicted} B, allocated {measured} B"
    assert (row["activations"] + row["gradients"]) / measured < 0.8  # kept activations alone miss the logits' gradients
