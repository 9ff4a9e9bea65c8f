"""runtime.compiled: every generated segment function under ``torch.compile`` gives eager's losses and gradients.

Every catalog recipe at 2 in-memory ranks (``run_ranks``), one forward and backward of a tiny LM (an embedding,
MLP blocks, a head; 4 blocks for the V-shaped schedules, 3 recycles for 3f1b, a vocabulary of 4 rows per
column so interlaced splits it), compiled against the same generated code run eagerly: losses and every
gradient at ``rtol=1e-5`` (fp32). The absolute tolerance is 1e-5 of each gradient's largest element, for the
elements whose exact value is 0 (inductor reorders float sums, so they come out ~1e-9 instead).

Backends, for the CI budget (2 cores; inductor compiles C++ per kernel: 24 s for dp from a cold cache, 86 s this file):
every recipe with ``backend="aot_eager"`` (Dynamo's graphs and the communication graph breaks, AOTAutograd's
forward and backward, no kernels: shows the split into graphs and the backward right), and dp, tp, 1f1b and zb1
with ``inductor``. The inductor tests need a C++ compiler and are skipped, saying so, without one.

zb1 splits each backward into B (input gradients) and W (weight gradients): each compiled graph's backward is
compiled as those two halves (``runtime.compiled_split``; its own tests in test_compiled_split.py), and its
gradients equal eager's.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_nnscaler as lnn
from lightning_nnscaler.codegen import module_from_source
from lightning_nnscaler.plans.catalog import list_recipes
from lightning_nnscaler.runtime import autograd_comm
from lightning_nnscaler.runtime.compiled import CompileOptions, compile_segments
from lightning_nnscaler.runtime.executor import RankExecutor, merge_gradients
from lightning_nnscaler.runtime.memory_comm import run_ranks

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_thread")]

CXX = next((found for name in (os.environ.get("CXX"), "g++", "c++", "clang++") if name and (found := shutil.which(name))), None)
"""The C++ compiler inductor's CPU kernels need (None: none on this machine)."""
NEEDS_CXX = pytest.mark.skipif(CXX is None, reason="inductor on CPU compiles C++ kernels: no C++ compiler (CXX, g++, c++, clang++) found")

PARAMS = {"coshard": {"shards": 2}, "hybrid": {"dp": 1, "tp": 2}, "hybrid3d": {"dp": 1, "tp": 1, "pp": 2}, "auto": {"recipes": "dp,zero3,1f1b"}}
"""Parameters that fit the tiny LM at 2 ranks; the catalog's defaults otherwise."""
V_SHAPED = ("zbv", "vhalf", "dualpipev")
INDUCTOR_RECIPES = ("dp", "tp", "1f1b", "zb1")


class Block(nn.Module):
    """A pre-norm MLP block with a residual."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 2 * hidden)
        self.fc2 = nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class TinyLM(L.LightningModule):
    """Embedding, ``layers`` MLP blocks, head; ``recycles - 1`` passes under ``no_grad`` first (as 3f1b needs)."""

    def __init__(self, layers: int = 2, recycles: int = 1, vocab: int = 64, hidden: int = 16, seq: int = 8) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.vocab, self.seq, self.recycles = vocab, seq, recycles

    def trunk(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int = 0) -> torch.Tensor:
        tokens, targets = batch
        if self.recycles == 1:
            x = self.embedding(tokens)
        else:  # AlphaFold2's recycling: every pass but the last without gradients
            recycled = torch.zeros(tokens.shape + (self.embedding.embedding_dim,))
            for _ in range(self.recycles - 1):
                with torch.no_grad():
                    recycled = self.trunk(self.embedding(tokens) + recycled)
            x = self.embedding(tokens) + recycled
        logits = self.head(self.trunk(x))
        return F.cross_entropy(logits.reshape(-1, self.vocab), targets.reshape(-1))

    def example_batch(self, rows: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randint(0, self.vocab, (rows, self.seq), generator=generator),
                torch.randint(0, self.vocab, (rows, self.seq), generator=generator))


@dataclasses.dataclass
class Step:
    """One step's losses (per rank), whole gradients, and rank 0's executed actions."""

    losses: list[torch.Tensor]
    gradients: dict[str, torch.Tensor]
    actions: list[str]


def plan_for(recipe: str) -> lnn.Plan:
    torch.manual_seed(0)
    model = TinyLM(layers=4 if recipe in V_SHAPED else 2, recycles=3 if recipe == "3f1b" else 1)
    batch = model.example_batch(8, torch.Generator().manual_seed(0))
    return lnn.parallelize(model, batch, recipe, 2, step="training_step", **PARAMS.get(recipe, {}))


def step(plan: lnn.Plan, compile: CompileOptions | None, tag: str) -> Step:
    """Forward and backward of every rank's generated module (fresh executors over the plan's module)."""
    inputs = plan.inputs()
    state = {**dict(plan.module.named_parameters()), **dict(plan.module.named_buffers())}

    def run_rank(communicator: Any) -> tuple[torch.Tensor, dict, list[str]]:
        rank = communicator.rank
        module = module_from_source(plan.sources[rank], f"compiled_{tag}_rank{rank}")
        executor = RankExecutor(module, rank, state, plan.graph.constant_values, communicator, input_offsets=plan.input_offsets(rank),
                                compile=compile)
        loss = executor.forward_backward(plan.replica_inputs(rank, inputs))
        return loss, executor.gradients(), [text for text, _, _ in executor.executed_actions]

    results = run_ranks(plan.world_size, run_rank, timeout=240)
    shapes = {key: tuple(value.shape) for key, value in plan.module.state_dict().items()}
    return Step([loss for loss, _, _ in results], merge_gradients([grads for _, grads, _ in results], shapes), results[0][2])


def assert_same_step(compiled: Step, eager: Step) -> None:
    torch.testing.assert_close(torch.stack(compiled.losses), torch.stack(eager.losses), rtol=1e-5, atol=0)
    assert compiled.gradients.keys() == eager.gradients.keys()
    for key, expected in eager.gradients.items():
        atol = 1e-5 * float(expected.abs().max())
        torch.testing.assert_close(compiled.gradients[key], expected, rtol=1e-5, atol=atol, msg=lambda m, k=key: f"{k}: {m}")
    assert compiled.actions == eager.actions


def compare(recipe: str, backend: str) -> tuple[Step, Step]:
    plan = plan_for(recipe)
    eager = step(plan, None, f"{recipe}_eager")
    start = time.perf_counter()
    compiled = step(plan, CompileOptions({"backend": backend}), f"{recipe}_{backend}")
    print(f"{recipe} {backend}: compiled step {time.perf_counter() - start:.1f} s")
    assert_same_step(compiled, eager)
    return compiled, eager


@pytest.mark.parametrize("recipe", [spec.name for spec in list_recipes()])
def test_every_recipe_compiled_with_aot_eager_gives_eager_losses_and_gradients(recipe: str) -> None:
    compare(recipe, "aot_eager")


@NEEDS_CXX
@pytest.mark.parametrize("recipe", INDUCTOR_RECIPES)
def test_recipes_compiled_with_inductor_give_eager_losses_and_gradients(recipe: str) -> None:
    compiled, _ = compare(recipe, "inductor")
    if recipe == "zb1":  # the weight halves ran as actions of their own, after their input halves
        assert any(action.startswith(("0W", "1W")) for action in compiled.actions), compiled.actions


def test_communication_is_a_graph_break_and_the_generated_module_is_unchanged() -> None:
    """tp's segments hold inline collectives: Dynamo compiles the compute between them, several graphs per segment,
    and the module keeps its own functions and ``comm`` (what ``Plan.save_code`` writes is what runs)."""
    plan = plan_for("tp")
    module = module_from_source(plan.sources[0], "compiled_tp_unchanged")
    segments = dict(module.SEGMENTS)
    compiled = compile_segments(module, CompileOptions({"backend": "aot_eager"}))
    assert compiled.keys() == segments.keys() and module.SEGMENTS == segments
    assert all(function.__globals__["comm"] is autograd_comm for function in segments.values())
    assert "comm.all_reduce(" in plan.sources[0] or "comm.send(" in plan.sources[0]
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # no reset: other tests' compiled kernels stay
    step(plan, CompileOptions({"backend": "aot_eager"}), "tp_graphs")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs > 2 * len(segments)


def test_compile_options_are_torch_compile_s() -> None:
    with pytest.raises(ValueError, match=r"compile_options \['backnd'\]: not options of torch.compile \(it takes backend, "):
        CompileOptions({"backnd": "inductor"})
    assert CompileOptions({"backend": "aot_eager", "dynamic": False}).options["dynamic"] is False


def test_the_strategy_compiles_with_its_options_or_with_a_compiled_module_s() -> None:
    """``NnScalerStrategy(compile=True, compile_options=...)`` hands its executors those options; without them, a module
    the user passed through ``torch.compile`` hands over its compile context (Lightning keeps it), as under ddp."""
    assert lnn.NnScalerStrategy().segment_compile is None
    strategy = lnn.NnScalerStrategy(compile=True, compile_options={"backend": "aot_eager"})
    assert strategy.segment_compile == CompileOptions({"backend": "aot_eager"})
    compiled_module = torch.compile(TinyLM(), backend="aot_eager")
    user = lnn.NnScalerStrategy()
    user._lightning_module = L.pytorch.utilities.compile.from_compiled(compiled_module)
    assert user.segment_compile is not None and user.segment_compile.compiler is compiled_module.dynamo_ctx
    assert user.lightning_module._compiler_ctx is None  # planned as written
    doubled = user.segment_compile.compile(lambda x: x * 2)
    assert torch.equal(doubled(torch.ones(2)), torch.full((2,), 2.0))
