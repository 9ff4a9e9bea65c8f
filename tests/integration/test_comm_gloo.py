"""TorchDistributedCommunicator over real gloo processes (2 and 4 ranks).

Each scenario runs on every rank of a fresh process group and returns tensors; the same scenario
run on the in-memory world (whose values and gradients the unit tests check against single-process
references) must give the same results. Failure scenarios check that a dead or silent peer raises
CommunicationError within the timeout instead of hanging.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_nnscaler.runtime import CommunicationError, MissingGroupError, TorchDistributedCommunicator, run_ranks
from lightning_nnscaler.runtime import autograd_comm as ac

SHAPE = (4, 6)  # dim 0 splits into 2 or 4 chunks
COMMUNICATION_TIMEOUT = 5.0  # seconds; the failure scenarios use shorter ones
KILLED_EXIT_CODE = 17

# forkserver: children fork from a clean server that imported the package and this module once (a
# spawned child pays seconds importing them), and no child inherits threads from the pytest process.
CONTEXT = multiprocessing.get_context("forkserver")
CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "lightning_nnscaler.runtime", "pytest", __name__])


def rank_input(rank: int) -> torch.Tensor:
    return torch.randn(SHAPE, dtype=torch.float64, generator=torch.Generator().manual_seed(10 + rank))


def pairs(world_size: int) -> list[tuple[int, ...]]:
    return [(rank, rank + 1) for rank in range(0, world_size, 2)]


def pair_of(rank: int) -> tuple[int, ...]:
    return (rank - rank % 2, rank - rank % 2 + 1)


def collectives_scenario(comm) -> dict:
    """Forward values of every op over the world, a subgroup and a p2p ring."""
    everyone, rank, n = tuple(range(comm.world_size)), comm.rank, comm.world_size
    comm.create_groups([everyone, *pairs(n)])
    x = rank_input(rank)
    message = x * 10
    comm.send(message, (rank + 1) % n, tag=0)
    message.zero_()  # send copied it: the receiver still gets x * 10
    results = {
        "all_reduce": comm.all_reduce(x, everyone),
        "all_reduce_pair": comm.all_reduce(x, pair_of(rank)),
        "all_gather": comm.all_gather(x, 1, everyone),
        "all_gather_pair": comm.all_gather(x, 0, pair_of(rank)),
        "reduce_scatter": comm.reduce_scatter(x, 0, everyone),
        "all_to_all": comm.all_to_all(x, 0, 1, everyone),
        "broadcast": comm.broadcast(x if rank == n - 1 else None, n - 1, everyone, SHAPE, torch.float64),
        "broadcast_pair": comm.broadcast(x if rank % 2 else None, pair_of(rank)[1], pair_of(rank), SHAPE, torch.float64),
        "ring": comm.recv(SHAPE, torch.float64, (rank - 1) % n, tag=0),
        "integers": comm.all_gather(torch.arange(3) * rank, 0, everyone),
    }
    buffer = x.clone()
    summed = comm.all_reduce_async(buffer, everyone, in_place=True).wait()
    results["all_reduce_in_place"] = buffer
    results["in_place_returns_its_buffer"] = torch.tensor(summed.data_ptr() == buffer.data_ptr())
    comm.wait_sends()
    comm.barrier()
    return results


def autograd_scenario(comm) -> dict:
    """Every autograd op consumes one input; one loss weights every output; returns the outputs and x's gradient."""
    everyone, rank, n = tuple(range(comm.world_size)), comm.rank, comm.world_size
    comm.create_groups(pairs(n))
    x = rank_input(rank).requires_grad_(True)
    token = ac.new_token()
    outputs = {}
    outputs["all_reduce"], token = ac.all_reduce(token, x, everyone, comm)
    outputs["all_reduce_pair"], token = ac.all_reduce(token, x.sin(), pair_of(rank), comm)
    outputs["all_gather"], token = ac.all_gather(token, x * x, 1, everyone, comm)
    outputs["reduce_scatter"], token = ac.reduce_scatter(token, x.exp(), 0, everyone, comm)
    outputs["all_to_all"], token = ac.all_to_all(token, x * (rank + 1), 0, 1, everyone, comm)
    source_value = x.cos() if rank == 1 else None
    outputs["broadcast"], token = ac.broadcast(token, source_value, 1, everyone, SHAPE, torch.float64, comm)
    token = ac.send(token, x.tanh(), (rank + 1) % n, 1, comm)
    token = ac.send(token, torch.arange(6).roll(rank), (rank + 1) % n, 2, comm)
    outputs["ring"], token = ac.recv(token, SHAPE, torch.float64, (rank - 1) % n, 1, comm)
    permutation, token = ac.recv(token, (6,), torch.int64, (rank - 1) % n, 2, comm)
    outputs["permuted"] = outputs["ring"][:, permutation] * outputs["broadcast"]
    generator = torch.Generator().manual_seed(rank)
    loss = sum((y * torch.randn(y.shape, dtype=y.dtype, generator=generator)).sum() for y in outputs.values())
    ac.backward(token, [loss])
    comm.wait_sends()
    comm.barrier()
    return {"gradient": x.grad, **{name: y.detach() for name, y in outputs.items()}}


def dp_autograd_scenario(comm) -> dict:
    """Replicated weights whose hook-started bucket sums interleave with token-chained backward communication.

    The weights over the world and over pairs share their tuples with the chain's collectives; even
    and odd ranks apply two weights in opposite orders, so their gradient hooks fire in different orders.
    """
    from lightning_nnscaler.runtime.reducer import GradientReducer

    everyone, rank, n = tuple(range(comm.world_size)), comm.rank, comm.world_size
    comm.create_groups([everyone, *pairs(n)])
    generator = torch.Generator().manual_seed(7)
    names = ["unused", "wa", "wb", "pair"]  # "unused" (no gradient) is the last bucket
    weights = {name: torch.nn.Parameter(torch.randn(SHAPE[1], SHAPE[1], dtype=torch.float64, generator=generator)) for name in names}
    replicated = [(weights[name], pair_of(rank) if name == "pair" else everyone) for name in names]
    reducer = GradientReducer(replicated, comm, rank, bucket_bytes=1)  # a bucket per weight
    first, second = ("wa", "wb") if rank % 2 == 0 else ("wb", "wa")
    x = rank_input(rank).requires_grad_(True)
    token = ac.new_token()
    h = x @ weights[first]
    h, token = ac.all_reduce(token, h, everyone, comm)
    h = h.tanh() @ weights["pair"]
    gathered, token = ac.all_gather(token, h, 0, pair_of(rank), comm)
    token = ac.send(token, h.sin(), (rank + 1) % n, 1, comm)
    ring, token = ac.recv(token, SHAPE, torch.float64, (rank - 1) % n, 1, comm)
    y = gathered.cos().sum(0) @ weights[second] + ring.sum()
    ac.backward(token, [y.square().sum()])
    comm.wait_sends()
    reducer.after_backward()
    comm.barrier()
    started = torch.tensor([[len(ranks), index, during] for ranks, index, during in reducer.started_buckets])
    return {"gradient": x.grad, "started": started, **{name: weight.grad for name, weight in weights.items()}}


def gpt_dp_scenario(comm) -> dict:
    """One forward/backward of GPT under the dp plan; this rank's summed parameter gradients by state key."""
    import lightning_nnscaler as lnn
    from lightning_nnscaler.codegen import module_from_source
    from lightning_nnscaler.models.gpt import GPT, GPTConfig
    from lightning_nnscaler.runtime.executor import RankExecutor

    torch.manual_seed(0)
    model = GPT(GPTConfig.small())
    batch = model.example_batch(4, torch.Generator().manual_seed(0))
    plan = lnn.parallelize(model, batch, "dp", comm.world_size, step="training_step")
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    module = module_from_source(plan.sources[comm.rank], f"rank{comm.rank}")
    executor = RankExecutor(module, comm.rank, state, plan.graph.constant_values, comm)
    inputs = {tensor.name: value for tensor, value in zip(plan.graph.user_inputs, lnn.flatten_inputs(batch, step="training_step"))}
    loss = executor.forward_backward(inputs)
    gradients = {key: grad for key, _, grad in executor.gradients().values()}
    during = [during for _, _, during in executor.reducer.started_buckets]
    return {"loss": loss, "gradients": gradients, "buckets": len(during), "started_during_backward": sum(during)}


def gpt_dp_accumulate_scenario(comm) -> dict:
    """Two half-weighted dp steps accumulated as DDP's no_sync does: the first keeps its gradients
    local, the second sums both; this rank's summed gradients by state key and the two losses."""
    import lightning_nnscaler as lnn
    from lightning_nnscaler.codegen import module_from_source
    from lightning_nnscaler.models.gpt import GPT, GPTConfig
    from lightning_nnscaler.runtime.executor import RankExecutor

    torch.manual_seed(0)
    model = GPT(GPTConfig.small())
    batches = [model.example_batch(4, torch.Generator().manual_seed(seed)) for seed in (0, 1)]
    plan = lnn.parallelize(model, batches[0], "dp", comm.world_size, step="training_step")
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    executor = RankExecutor(module_from_source(plan.sources[comm.rank], f"rank{comm.rank}"), comm.rank, state, plan.graph.constant_values, comm)
    losses = []
    for index, batch in enumerate(batches):
        inputs = {tensor.name: value for tensor, value in zip(plan.graph.user_inputs, lnn.flatten_inputs(batch, step="training_step"))}
        losses.append(executor.forward_backward(inputs, loss_scale=0.5, reduce_gradients=index == 1))
    gradients = {key: grad for key, _, grad in executor.gradients().values()}
    return {"losses": torch.stack(losses), "gradients": gradients, "buckets_started": len(executor.reducer.started_buckets)}


def group_errors_scenario(comm) -> dict:
    """A group that was not created upfront, and ranks that pass different tuples to create_groups."""
    messages = {}
    try:
        comm.all_reduce(torch.ones(1), pair_of(comm.rank))
    except MissingGroupError as error:
        messages["missing"] = str(error)
    try:
        comm.create_groups([(0, 1)] if comm.rank == 0 else [(0, 1), (2, 3)])
    except ValueError as error:
        messages["mismatch"] = str(error)
    comm.barrier()  # the failed create_groups left every rank in step
    return messages


def killed_peer_scenario(comm) -> dict:
    """The last rank dies after one collective; the others block on it (p2p and a collective)."""
    comm.all_reduce(torch.ones(2), tuple(range(comm.world_size)))
    if comm.rank == comm.world_size - 1:
        os._exit(KILLED_EXIT_CODE)
    start = time.monotonic()
    try:
        if comm.rank == 0:
            comm.recv((2,), torch.float32, comm.world_size - 1, tag=0)
        else:
            comm.all_reduce(torch.ones(2), tuple(range(comm.world_size)))
    except CommunicationError as error:
        return {"error": str(error), "elapsed": time.monotonic() - start}
    return {"error": None}


def silent_peer_scenario(comm) -> dict:
    """Rank 0 waits for a message rank 1 never sends."""
    start = time.monotonic()
    if comm.rank == 1:
        time.sleep(2 * comm.timeout)  # alive but silent until rank 0 timed out
        os._exit(0)
    try:
        comm.recv((2,), torch.float32, 1, tag=3)
    except CommunicationError as error:
        return {"error": str(error), "elapsed": time.monotonic() - start}
    return {"error": None}


def release_scenario(comm) -> dict:
    """Rank 0 sends three messages; rank 1 answers once it has them all; rank 0 then releases one, then waits for all."""
    if comm.rank == 1:
        for tag in (1, 2, 3):
            comm.recv((4,), torch.float32, 0, tag)
        comm.send(torch.ones(1), 0, 9)
        comm.wait_sends()
        return {}
    for tag in (1, 2, 3):
        comm.send(torch.full((4,), float(tag)), 1, tag)
    counts = [comm.sends_in_flight]
    comm.recv((1,), torch.float32, 1, 9)
    comm.release_send(1, 2)
    counts.append(comm.sends_in_flight)
    comm.release_send(1, 7)  # nothing sent with that tag: nothing to release
    counts.append(comm.sends_in_flight)
    comm.wait_sends()
    return {"counts": counts + [comm.sends_in_flight]}


def posted_scenario(comm) -> dict:
    """Rank 1 posts its receives before rank 0 sends (one out of tag order), then receives them where it uses them; a
    receive never posted still works, and a second post of a pending one is refused by name."""
    if comm.rank == 0:
        for tag in (1, 2, 3):
            comm.send(torch.full((2,), float(tag)), 1, tag)
        comm.wait_sends()
        return {}
    comm.post_recv((2,), torch.float32, 0, 2)
    comm.post_recv((2,), torch.float32, 0, 1)
    try:
        comm.post_recv((2,), torch.float32, 0, 1)
        refused = None
    except CommunicationError as error:
        refused = str(error)
    values = [comm.recv((2,), torch.float32, 0, tag)[0].item() for tag in (1, 2, 3)]
    return {"values": values, "refused": refused, "posted_left": len(comm._posted)}


SCENARIOS = {
    "posted": (posted_scenario, COMMUNICATION_TIMEOUT),
    "collectives": (collectives_scenario, COMMUNICATION_TIMEOUT),
    "autograd": (autograd_scenario, COMMUNICATION_TIMEOUT),
    "dp_autograd": (dp_autograd_scenario, COMMUNICATION_TIMEOUT),
    "gpt_dp": (gpt_dp_scenario, 30.0),
    "gpt_dp_accumulate": (gpt_dp_accumulate_scenario, 30.0),
    "group_errors": (group_errors_scenario, COMMUNICATION_TIMEOUT),
    "killed_peer": (killed_peer_scenario, 3.0),
    "silent_peer": (silent_peer_scenario, 1.0),
    "release": (release_scenario, COMMUNICATION_TIMEOUT),
}


def _worker(rank: int, world_size: int, port: int, scenario: str, out_dir: str) -> None:
    """One process: join the group, run the scenario, save its result (or the traceback), exit."""
    torch.set_num_threads(1)  # 4 ranks share 2 cores in CI
    program, timeout = SCENARIOS[scenario]
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=timedelta(seconds=20)
        )
        torch.save(program(TorchDistributedCommunicator(timeout)), Path(out_dir, f"rank{rank}.pt"))
    except BaseException:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)
    # Skip interpreter teardown: a group whose peer died must not be waited on at exit.
    os._exit(0)


@dataclass(frozen=True)
class Outcome:
    exitcode: int | None
    result: dict | None
    error: str | None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(world_size: int, scenario: str, out_dir: Path, deadline_s: float = 45.0) -> tuple[list[Outcome], float]:
    """Run ``scenario`` on ``world_size`` gloo processes; return each rank's outcome and the elapsed seconds."""
    port, start = free_port(), time.monotonic()
    processes = [
        CONTEXT.Process(target=_worker, args=(rank, world_size, port, scenario, str(out_dir)), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(max(0.0, start + deadline_s - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()  # a hung rank: reported through its exit code below
            process.join()
    elapsed = time.monotonic() - start
    outcomes = []
    for rank, process in enumerate(processes):
        result_path, error_path = out_dir / f"rank{rank}.pt", out_dir / f"rank{rank}.err"
        result = torch.load(result_path) if result_path.exists() else None
        outcomes.append(Outcome(process.exitcode, result, error_path.read_text() if error_path.exists() else None))
    return outcomes, elapsed


def assert_succeeded(outcomes: list[Outcome]) -> None:
    failures = [f"rank {rank}: exit code {o.exitcode}\n{o.error}" for rank, o in enumerate(outcomes) if o.exitcode != 0]
    assert not failures, "\n".join(failures)


def assert_same_results(actual: dict, expected: dict, rank: int) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, msg=f"{name} on rank {rank}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("scenario", ["collectives", "autograd"])
def test_gloo_gives_the_in_memory_worlds_values_and_gradients(scenario, world_size, tmp_path):
    outcomes, _ = launch(world_size, scenario, tmp_path)
    assert_succeeded(outcomes)
    program, _ = SCENARIOS[scenario]
    expected = run_ranks(world_size, program, timeout=COMMUNICATION_TIMEOUT)
    for rank, outcome in enumerate(outcomes):
        assert_same_results(outcome.result, expected[rank], rank)
    sums = [outcome.result["all_reduce"] for outcome in outcomes]
    assert all(torch.equal(total, sums[0]) for total in sums), "all_reduce differs bitwise between ranks"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 4])
def test_hook_started_gradient_sums_interleave_with_backward_communication(world_size, tmp_path):
    outcomes, _ = launch(world_size, "dp_autograd", tmp_path)
    assert_succeeded(outcomes)
    expected = run_ranks(world_size, dp_autograd_scenario, timeout=COMMUNICATION_TIMEOUT)
    for rank, outcome in enumerate(outcomes):
        assert_same_results(outcome.result, expected[rank], rank)
        assert outcome.result["started"][:, 2].any(), f"rank {rank} started no bucket during backward"
        for group_size in outcome.result["started"][:, 0].unique():
            indices = outcome.result["started"][outcome.result["started"][:, 0] == group_size][:, 1]
            assert indices.tolist() == list(range(len(indices))), f"rank {rank} started buckets out of order"


def single_device_gpt() -> torch.nn.Module:
    """The GPT reference with the workers' initial weights (seed 0), logging switched off."""
    from lightning_nnscaler.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.small())
    model.log = lambda *args, **kwargs: None
    return model


@pytest.mark.timeout(120)
def test_dp_gpt_gradients_on_two_gloo_ranks_equal_single_device(tmp_path):
    outcomes, _ = launch(2, "gpt_dp", tmp_path, deadline_s=100.0)
    assert_succeeded(outcomes)
    model = single_device_gpt()
    loss = model.training_step(model.example_batch(4, torch.Generator().manual_seed(0)), 0)
    loss.backward()
    expected = {key: parameter.grad for key, parameter in model.named_parameters()}
    for rank, outcome in enumerate(outcomes):
        result = outcome.result
        torch.testing.assert_close(result["loss"], loss.detach(), rtol=1e-5, atol=1e-6)
        assert result["gradients"].keys() == expected.keys()
        for key, grad in expected.items():
            torch.testing.assert_close(result["gradients"][key], grad, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k} on rank {rank}: {m}")
        assert result["buckets"] >= 1 and result["started_during_backward"] >= 1
    for key in expected:
        assert torch.equal(outcomes[0].result["gradients"][key], outcomes[1].result["gradients"][key]), key


@pytest.mark.timeout(120)
def test_dp_gpt_accumulation_sums_once_and_equals_single_device(tmp_path):
    outcomes, _ = launch(2, "gpt_dp_accumulate", tmp_path, deadline_s=100.0)
    assert_succeeded(outcomes)
    model = single_device_gpt()
    losses = []
    for seed in (0, 1):
        loss = model.training_step(model.example_batch(4, torch.Generator().manual_seed(seed)), 0)
        (loss * 0.5).backward()
        losses.append(loss.detach())
    expected = {key: parameter.grad for key, parameter in model.named_parameters()}
    for rank, outcome in enumerate(outcomes):
        result = outcome.result
        torch.testing.assert_close(result["losses"], torch.stack(losses), rtol=1e-5, atol=1e-6)
        assert result["buckets_started"] == 1, "the local step must not start a bucket; the summing step starts the one bucket"
        for key, grad in expected.items():
            torch.testing.assert_close(result["gradients"][key], grad, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k} on rank {rank}: {m}")
    for key in expected:
        assert torch.equal(outcomes[0].result["gradients"][key], outcomes[1].result["gradients"][key]), key


@pytest.mark.timeout(60)
def test_group_errors_name_the_fix_on_every_rank(tmp_path):
    outcomes, _ = launch(4, "group_errors", tmp_path)
    assert_succeeded(outcomes)
    for outcome in outcomes:
        assert "create_groups(...) on every rank" in outcome.result["missing"]
        assert "same rank tuples on every rank" in outcome.result["mismatch"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 4])
def test_a_killed_rank_makes_the_others_raise_instead_of_hang(world_size, tmp_path):
    outcomes, elapsed = launch(world_size, "killed_peer", tmp_path)
    assert elapsed < 60
    assert outcomes[-1].exitcode == KILLED_EXIT_CODE
    assert_succeeded(outcomes[:-1])
    for outcome in outcomes[:-1]:
        assert outcome.result["error"] is not None, "a survivor's wait on the dead rank returned normally"
        assert outcome.result["elapsed"] < SCENARIOS["killed_peer"][1] + 5
    assert f"recv from rank {world_size - 1} with tag 0" in outcomes[0].result["error"]


@pytest.mark.timeout(60)
def test_a_silent_peer_times_out_naming_op_peer_tag_and_timeout(tmp_path):
    outcomes, _ = launch(2, "silent_peer", tmp_path)
    assert_succeeded(outcomes)
    result = outcomes[0].result
    assert "rank 0: recv from rank 1 with tag 3 failed or did not complete within 1.0 s" in result["error"]
    assert 0.9 < result["elapsed"] < 5


@pytest.mark.timeout(60)
def test_a_released_send_drops_its_copy_and_the_rest_wait_for_wait_sends(tmp_path):
    outcomes, _ = launch(2, "release", tmp_path)
    assert_succeeded(outcomes)
    assert outcomes[0].result == {"counts": [3, 2, 2, 0]}


@pytest.mark.timeout(60)
def test_a_receive_posted_ahead_returns_its_message_where_it_is_received(tmp_path):
    outcomes, _ = launch(2, "posted", tmp_path)
    assert_succeeded(outcomes)
    assert outcomes[1].result == {
        "values": [1.0, 2.0, 3.0], "refused": "rank 1: a receive from rank 0 with tag 1 is already posted", "posted_left": 0,
    }
