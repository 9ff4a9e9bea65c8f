"""runtime.compiled_split: zero-bubble under ``torch.compile``, each compiled graph's backward as an input half (I) and a
weight half (W), each compiled, that together run the backward's ops once.

A small GPT (``models.gpt``, hidden 32) planned with zb1 (2 stages) and zbv (V-shape, 2 stages per rank) at 2
in-memory ranks (``run_ranks``), 4 microbatches, compiled against the same generated code run eagerly: losses and
every gradient at ``rtol=1e-5``: ``aot_eager`` gives eager's numbers exactly (``atol=0``); ``inductor`` (it reorders
float sums) within 3e-8 absolute on this model (``atol=1e-7``: the key projections' bias has gradient 0 exactly). Then the op counts of the FX graphs: I's and W's nodes together are
the whole backward's, W holds every weight matmul and no input-gradient op, and per step each half runs once per
segment (W is never the I graph run again).

The last tests use ``runtime.split_backward`` directly on compiled functions: the parameters' post-accumulate-grad
hooks fire in W only, once each; and a parameter read by two compiled graphs (a graph break between them, as inline
communication makes) puts both graphs in one group, whose backwards stay whole and run in both I and W (the
behaviour ``runtime.compiled`` describes), with the same gradients.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest
import torch
from test_compiled_segments import NEEDS_CXX, Step

import lightning_nnscaler as lnn
from lightning_nnscaler.codegen import module_from_source
from lightning_nnscaler.models.gpt import Block, GPT, GPTConfig
from lightning_nnscaler.runtime.compiled import CompileOptions
from lightning_nnscaler.runtime.compiled_split import SplitBackend, SplitBackward, split_backend
from lightning_nnscaler.runtime.executor import RankExecutor, merge_gradients
from lightning_nnscaler.runtime.memory_comm import run_ranks
from lightning_nnscaler.runtime.split_backward import input_gradients

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_thread")]

MATMULS = ("mm", "addmm", "bmm")
INPUT_ONLY = ("gelu_backward", "_scaled_dot_product_flash_attention_for_cpu_backward", "_softmax_backward_data")
"""Backward ops on the way to the inputs only (activation, attention): never in a weight half."""


@dataclasses.dataclass
class CompiledRun:
    """A step, and per rank the split backwards its compiled graphs made."""

    step: Step
    splits: list[list[SplitBackward]]


def gpt_plan(recipe: str) -> lnn.Plan:
    """A small GPT (2 blocks for zb1, 4 for zbv's four stages) planned at 2 ranks, 4 microbatches."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, seq_len=16, hidden=32, layers=2 if recipe == "zb1" else 4, heads=4))
    return lnn.parallelize(model, model.example_batch(8, torch.Generator().manual_seed(0)), recipe, 2, step="training_step", microbatches=4)


def run(plan: lnn.Plan, compile: CompileOptions | None, tag: str) -> CompiledRun:
    """One forward and backward of every rank's generated module; the split backwards each rank compiled."""
    inputs = plan.inputs()
    state = {**dict(plan.module.named_parameters()), **dict(plan.module.named_buffers())}

    def run_rank(communicator: Any) -> tuple[torch.Tensor, dict, list[str], list[SplitBackward]]:
        rank = communicator.rank
        module = module_from_source(plan.sources[rank], f"split_{tag}_rank{rank}")
        executor = RankExecutor(module, rank, state, plan.graph.constant_values, communicator, input_offsets=plan.input_offsets(rank),
                                compile=compile)
        loss = executor.forward_backward(plan.replica_inputs(rank, inputs))
        backends = next(iter(executor.segments.values())).split_backends or [] if executor.segments else []
        return loss, executor.gradients(), [text for text, _, _ in executor.executed_actions], [split for backend in backends for split in backend.splits]

    results = run_ranks(plan.world_size, run_rank, timeout=240)
    shapes = {key: tuple(value.shape) for key, value in plan.module.state_dict().items()}
    step = Step([loss for loss, *_ in results], merge_gradients([grads for _, grads, _, _ in results], shapes), results[0][2])
    return CompiledRun(step, [splits for *_, splits in results])


@pytest.fixture(scope="module")
def zb1_aot_eager() -> tuple[CompiledRun, Step]:
    plan = gpt_plan("zb1")
    return run(plan, CompileOptions({"backend": "aot_eager"}), "zb1_aot_eager"), run(plan, None, "zb1_eager").step


def assert_same_step(compiled: Step, eager: Step, atol: float = 0.0) -> None:
    """Losses and every gradient at fp32 ``rtol=1e-5``, and ``atol`` (a GPT's key bias has gradient 0 exactly: the
    softmax ignores it, so eager's is ~1e-17 and inductor's reordered sums ~1e-11)."""
    torch.testing.assert_close(torch.stack(compiled.losses), torch.stack(eager.losses), rtol=1e-5, atol=0)
    assert compiled.gradients.keys() == eager.gradients.keys() and compiled.actions == eager.actions
    for key, expected in eager.gradients.items():
        torch.testing.assert_close(compiled.gradients[key], expected, rtol=1e-5, atol=atol, msg=lambda m, k=key: f"{k}: {m}")


def ops(graph: torch.fx.GraphModule | None) -> Counter[str]:
    """The graph's ops by name (overload packet)."""
    if graph is None:
        return Counter()
    return Counter(getattr(node.target, "__name__", str(node.target)).split(".")[0] for node in graph.graph.nodes if node.op == "call_function")


def assert_split(splits: list[list[SplitBackward]], first_stage_ranks: set[int] = frozenset()) -> None:
    """Every graph's backward ran each half once: W deferred where its segment has input gradients; in a first stage
    (no input gradient, so no input half) W is the whole backward."""
    for rank, rank_splits in enumerate(splits):
        assert rank_splits, f"rank {rank} compiled no split backward"
        for split in rank_splits:
            if split.input_part is None:
                assert rank in first_stage_ranks and dict(split.runs) == {"weight": 1}, (rank, dict(split.runs))
            else:
                assert dict(split.runs) == {"input": 1, "deferred": 1, "weight": 1}, (rank, dict(split.runs))


def test_zb1_gpt_compiled_with_aot_eager_equals_eager_and_defers_every_weight_half(zb1_aot_eager: tuple[CompiledRun, Step]) -> None:
    compiled, eager = zb1_aot_eager
    assert_same_step(compiled.step, eager)
    assert_split(compiled.splits, first_stage_ranks={0})
    assert len(compiled.splits[1]) == 4  # one graph per segment (stage 1, microbatches 0-3)


def test_the_halves_hold_the_backward_s_ops_once_and_w_no_input_gradient_op(zb1_aot_eager: tuple[CompiledRun, Step]) -> None:
    """Stage 1 is a GPT block, the final norm and the head: 7 linears, so 7 weight matmuls in W; I holds the input
    matmuls (7) and attention's."""
    compiled, _ = zb1_aot_eager
    for split in compiled.splits[1]:
        whole, input_ops, weight_ops = ops(split.parts.graph), ops(split.parts.input_graph), ops(split.parts.weight_graph)
        assert input_ops + weight_ops == whole
        assert sum(weight_ops[name] for name in MATMULS) == 7
        assert sum(input_ops[name] for name in MATMULS) == sum(whole[name] for name in MATMULS) - 7
        assert not set(INPUT_ONLY) & set(weight_ops) and set(INPUT_ONLY) & set(input_ops)


def test_zbv_gpt_compiled_with_aot_eager_equals_eager() -> None:
    plan = gpt_plan("zbv")
    compiled, eager = run(plan, CompileOptions({"backend": "aot_eager"}), "zbv_aot_eager"), run(plan, None, "zbv_eager").step
    assert_same_step(compiled.step, eager)
    assert_split(compiled.splits, first_stage_ranks={0})
    assert sum(split.runs["deferred"] for split in compiled.splits[0]) == 4  # rank 0's V-shape: stage 3 has input gradients


@NEEDS_CXX
def test_zb1_gpt_compiled_with_inductor_equals_eager() -> None:
    plan = gpt_plan("zb1")
    compiled, eager = run(plan, CompileOptions({"backend": "inductor"}), "zb1_inductor"), run(plan, None, "zb1_inductor_eager").step
    assert_same_step(compiled.step, eager, atol=1e-7)  # measured: 3e-8 (k_proj's bias, whose exact gradient is 0: ~1e-11)
    assert_split(compiled.splits, first_stage_ranks={0})
    for split in compiled.splits[1]:
        assert sum(ops(split.parts.weight_graph)[name] for name in MATMULS) == 7


def blocks() -> torch.nn.Module:
    """Two GPT blocks with seed-0 weights."""
    torch.manual_seed(0)
    return torch.nn.Sequential(Block(GPTConfig.small()), Block(GPTConfig.small()))


def leaf() -> torch.Tensor:
    return torch.randn(4, 16, GPTConfig.small().hidden, generator=torch.Generator().manual_seed(1)).requires_grad_()


def test_w_fires_each_parameter_s_hook_once_and_i_none() -> None:
    model, reference = blocks(), blocks()
    expected = leaf()
    (reference(expected) ** 2).sum().backward()
    fired: Counter[int] = Counter()
    for parameter in model.parameters():
        parameter.register_post_accumulate_grad_hook(lambda tensor: fired.update([id(tensor)]))
    backend = SplitBackend("aot_eager")
    compiled = torch.compile(model, backend=backend)
    boundary = leaf()
    (gradient,), weight_pass = input_gradients((compiled(boundary) ** 2).sum(), [boundary], list(model.parameters()))
    assert not fired and all(parameter.grad is None for parameter in model.parameters())
    weight_pass.accumulate()
    assert fired == Counter(id(parameter) for parameter in model.parameters())
    assert [dict(split.runs) for split in backend.splits] == [{"input": 1, "deferred": 1, "weight": 1}]
    torch.testing.assert_close(gradient, expected.grad, rtol=0, atol=0)
    for parameter, plain in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(parameter.grad, plain.grad, rtol=0, atol=0)


def test_a_parameter_read_by_two_graphs_keeps_their_backwards_whole() -> None:
    """A graph break between two uses of one linear: its two graphs are junctions of one group, which W runs as before
    (each graph's whole backward in I and again in W), with the same gradients."""
    def forward(x: torch.Tensor, shared: torch.nn.Linear, alone: torch.nn.Linear) -> torch.Tensor:
        x = shared(x).relu()
        torch._dynamo.graph_break()
        return alone(shared(x).relu())

    def gradients(compiled: bool) -> tuple[list[torch.Tensor], list[dict[str, int]]]:
        torch.manual_seed(0)
        shared, alone = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        backend = SplitBackend("aot_eager")
        function = torch.compile(forward, backend=backend) if compiled else forward
        boundary = torch.randn(3, 8, generator=torch.Generator().manual_seed(2)).requires_grad_()
        parameters = [*shared.parameters(), *alone.parameters()]
        (gradient,), weight_pass = input_gradients((function(boundary, shared, alone) ** 2).sum(), [boundary], parameters)
        weight_pass.accumulate()
        return [gradient, *(parameter.grad for parameter in parameters)], [dict(split.runs) for split in backend.splits]

    compiled, runs = gradients(True)
    for split, plain in zip(compiled, gradients(False)[0], strict=True):
        torch.testing.assert_close(split, plain, rtol=1e-6, atol=1e-7)
    assert len(runs) == 2 and all(run["input"] == run["weight"] == 2 and "deferred" not in run for run in runs), runs


def test_only_inductor_and_aot_eager_split() -> None:
    assert split_backend({"backend": "eager"}) is None and split_backend({"backend": "cudagraphs"}) is None
    backend, rest = split_backend({"backend": "inductor", "mode": "max-autotune-no-cudagraphs", "dynamic": False})
    assert backend.name == "inductor" and backend.config.get("max_autotune") is True and rest == {"dynamic": False}
    assert split_backend({"backend": "aot_eager", "fullgraph": True})[1] == {"fullgraph": True}
    split: list[SplitBackend] = []
    CompileOptions(compiler=torch.compile(backend="aot_eager")).compile(lambda x: x, split)
    assert split == []  # a user's compile context keeps its own backend: backwards whole


def test_a_torch_that_cannot_start_w_at_a_compiled_graph_is_refused_before_any_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Torch 2.11 cannot run W from a compiled graph's node: compiled zero-bubble segments are refused when made, naming
    the way out; a schedule without W still compiles."""
    from lightning_nnscaler.runtime import compiled

    monkeypatch.setattr(compiled, "ZERO_BUBBLE_COMPILE_TORCH", (99, 0))
    plan = gpt_plan("zb1")
    module = module_from_source(plan.sources[0], "split_refused_rank0")
    with pytest.raises(RuntimeError, match=r"compile=True with a zero-bubble schedule .* needs torch >= 99.0 .*compile=False"):
        compiled.compile_segments(module, CompileOptions({"backend": "aot_eager"}))
    one_f_one_b = gpt_plan("1f1b")
    assert compiled.compile_segments(module_from_source(one_f_one_b.sources[0], "split_allowed_rank0"), CompileOptions({"backend": "aot_eager"}))
