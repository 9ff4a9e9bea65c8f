"""Pipelined plans (gpipe, 1f1b, interleaved, zb1, hybrid3d): equivalence, generated segments, schedule checks."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.codegen import module_from_source
from lightning_nnscaler.runtime.pipeline import module_actions
from lightning_nnscaler.models.evoformer import Evoformer, EvoformerConfig
from lightning_nnscaler.models.gpt import GPT, GPTConfig
from lightning_nnscaler.models.mbart import MBart, MBartConfig
from lightning_nnscaler.models.swin import Swin, SwinConfig
from lightning_nnscaler.ir.validate import PlanError
from lightning_nnscaler.materialize.program import Recv
from lightning_nnscaler.materialize.steps import check_message_order
from lightning_nnscaler.plan import build_plan
from lightning_nnscaler.plans.context import PipelinePlan, PlanContext
from lightning_nnscaler.plans.pipeline import PipelineSettings, pipeline
from lightning_nnscaler.plans.stage_cuts import cut_stages, op_cost
from lightning_nnscaler.schedules import Schedule, ScheduleError, one_f_one_b, peak_in_flight


def gpt_and_batch(batch_size: int = 8) -> tuple[GPT, object]:
    torch.manual_seed(0)
    model = GPT(GPTConfig.small())
    return model, model.example_batch(batch_size, torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    ("recipe", "world_size", "params"),
    [
        ("gpipe", 2, {}),  # tests/integration/test_pipelines_gloo.py trains every schedule at 4 real ranks
        ("1f1b", 2, {}),
        ("hybrid3d", 8, {"dp": 2, "tp": 2, "pp": 2}),
        ("hybrid3d", 16, {"dp": 2, "tp": 2, "pp": 4}),
        ("interleaved", 4, {"microbatches": 4, "virtual_stages": 2}),
        ("zb1", 4, {"microbatches": 8}),
    ],
)
def test_pipelined_plans_verify_against_one_device(recipe: str, world_size: int, params: dict) -> None:
    model, batch = gpt_and_batch()
    plan = lnn.parallelize(model, batch, recipe, world_size, step="training_step", **params)
    report = plan.verify()
    assert report.parameters_checked == len(list(model.parameters()))


@pytest.mark.parametrize("model_class", [Swin, MBart], ids=["swin", "mbart"])
def test_reference_models_run_1f1b_at_4_ranks(model_class: type) -> None:
    torch.manual_seed(0)
    model = model_class((SwinConfig if model_class is Swin else MBartConfig).small())
    plan = lnn.parallelize(model, model.example_batch(4, torch.Generator().manual_seed(0)), "1f1b", 4, step="training_step")
    plan.verify()


def test_each_rank_runs_one_function_per_segment_in_its_schedule_order() -> None:
    model, batch = gpt_and_batch()
    plan = lnn.parallelize(model, batch, "1f1b", 2, step="training_step", microbatches=4)
    expected = one_f_one_b(2, 4).as_text()
    for rank, source in enumerate(plan.sources):
        assert [str(action) for action in plan.program.actions[rank] if action.kind.is_compute] == expected[rank]
        assert module_actions(module_from_source(source, f"schedule_order_rank{rank}")) == list(plan.program.actions[rank])
        functions = re.findall(r"^def (stage\d+_microbatch\d+)\(held, shared, received, communicator, token\):", source, re.M)
        assert functions == [f"stage{rank}_microbatch{microbatch}" for microbatch in range(4)]
        assert "def prologue(held, communicator, token):" in source and "def forward(" not in source


def test_stages_are_cut_between_blocks_and_hand_over_the_residual_stream_alone() -> None:
    """The cut lands where the fewest bytes cross: one (rows, seq, hidden) tensor per microbatch."""
    model, batch = gpt_and_batch()
    plan = lnn.parallelize(model, batch, "gpipe", 2, step="training_step", microbatches=2)
    received = re.findall(r"^    \((\d+), (\d+)\): \[(.*)\],$", plan.sources[1].split("BOUNDARY_OUT")[0].split("BOUNDARY_IN")[1], re.M)
    assert [(stage, microbatch) for stage, microbatch, _ in received] == [("1", "0"), ("1", "1")]
    for _, _, messages in received:
        assert messages.count("torch.float32") == 1 and "(4, 16, 32)" in messages
    graph = lnn.trace(model, batch, step="training_step")
    stage_of = cut_stages(graph, 2).stage_of
    assert {stage_of[op.name] for op in graph.ops if "blocks_0" in str(op)} == {0}
    assert {stage_of[op.name] for op in graph.ops if "blocks_1" in str(op) or "lm_head" in str(op)} == {1}


def test_explain_shows_the_grid_the_bubble_and_what_1f1b_stashes() -> None:
    model, batch = gpt_and_batch()
    explained = {recipe: lnn.parallelize(model, batch, recipe, 2, step="training_step", microbatches=8).explain() for recipe in ("gpipe", "1f1b")}
    assert "bubble 11.1%" in explained["1f1b"] and "(p-1)/(m+p-1) = 11.1%" in explained["1f1b"]
    assert "step | rank 0 | rank 1" in explained["1f1b"]

    def stage0_activations(text: str) -> float:
        return float(text.splitlines()[2].split()[7])

    seed = 1 * 16 * 32 * 4 / 1024  # KiB: one microbatch's output gradient (1 row), held by stage 0 while a B runs
    assert stage0_activations(explained["gpipe"]) - seed == pytest.approx(4 * (stage0_activations(explained["1f1b"]) - seed))  # m=8 vs p=2 stashed


def hand_plan(actions: list[list[str]]) -> Exception:
    """Build a 2-rank, 2-microbatch 1F1B plan but run it under the hand-written ``actions``."""
    model, batch = gpt_and_batch(4)
    graph = lnn.trace(model, batch, step="training_step")
    planned = graph.copy()
    ctx = PlanContext(2)
    pipeline(planned, ctx, "1f1b", PipelineSettings(microbatches=2))
    bad = PipelinePlan(Schedule.from_text(actions, (0, 1), 2), ctx.pipeline.column_of_rank)
    with pytest.raises(ScheduleError) as caught:
        build_plan(model, batch, "training_step", graph, planned, 2, pipeline=bad)
    return caught.value


GRID = re.compile(r"^step \| rank 0 +\| rank 1", re.M)


def test_a_backward_before_its_forward_is_refused_with_the_grid() -> None:
    error = str(hand_plan([["0F0", "0B0", "0F1", "0B1"], ["1B0", "1F0", "1F1", "1B1"]]))
    assert GRID.search(error) and "*1B0*" in error and "a backward before its forward" in error


def test_crossed_messages_are_refused_with_the_grid() -> None:
    error = str(hand_plan([["0F0", "0F1", "0B0", "0B1"], ["1F1", "1F0", "1B0", "1B1"]]))
    assert GRID.search(error) and "crossed send/recv order from rank 0 to rank 1" in error


def test_a_cross_rank_cycle_is_refused_with_the_grid() -> None:
    error = str(hand_plan([["0F0", "0B0", "0F1", "0B1"], ["1F0", "1F1", "1B0", "1B1"]]))
    assert GRID.search(error) and "cross-rank cycle: rank 0 -> rank 1 -> rank 0" in error


@pytest.mark.parametrize(
    ("recipe", "params", "message"),
    [
        ("1f1b", {"microbatches": 3}, r"microbatches \(3\) must divide each replica's batch \(8 rows\)"),
        ("1f1b", {"stages": 3}, r"stages \(3\) must be a positive divisor of world_size \(4\)"),
        ("interleaved", {"microbatches": 2, "virtual_stages": 2}, "microbatches divisible by ranks"),
        ("hybrid3d", {"dp": 2, "tp": 1, "pp": 3}, r"dp \(2\) × tp \(1\) × pp \(3\) = 6 must equal world_size \(4\)"),
    ],
)
def test_bad_pipeline_parameters_are_refused_naming_the_setting(recipe: str, params: dict, message: str) -> None:
    model, batch = gpt_and_batch()
    with pytest.raises(ValueError, match=message):
        lnn.parallelize(model, batch, recipe, 4, step="training_step", **params)


def recycling_model() -> Evoformer:
    torch.manual_seed(0)
    return Evoformer(dataclasses.replace(EvoformerConfig.small(), recycles=3))


def test_3f1b_pipelines_the_recycling_passes_and_verifies_at_8_virtual_ranks() -> None:
    model = recycling_model()
    plan = lnn.parallelize(model, model.example_batch(8, torch.Generator().manual_seed(0)), "3f1b", 8, step="training_step")
    schedule = plan.pipeline.schedule
    assert (schedule.stages, schedule.forward_only, schedule.microbatches) == (24, 16, 8)  # r = 3 read from the graph
    for rank_actions in schedule.actions:
        kinds = [action.kind.value for action in rank_actions]
        assert kinds.count("F") == 3 * kinds.count("B") == 3 * 8  # three forwards per backward
        assert all(action.stage >= 16 for action in rank_actions if action.kind.value == "B")
    assert max(peak_in_flight(schedule)) <= 8 + 8  # recycling forwards stash nothing
    recycling = plan.sources[0].split("def stage8_microbatch0")[1].split("\ndef ")[0]
    assert "with torch.no_grad()" in recycling
    assert "BOUNDARY_OUT" in plan.sources[7] and ", False)" in plan.sources[7].split("BOUNDARY_OUT")[1].split("}")[0]
    plan.verify()


def test_3f1b_refuses_a_model_that_does_not_recycle() -> None:
    model, batch = gpt_and_batch()
    with pytest.raises(ValueError, match=r"3f1b: the model has no recycling passes .*use 1f1b"):
        lnn.parallelize(model, batch, "3f1b", 2, step="training_step")


def test_boundary_messages_received_out_of_send_order_are_refused() -> None:
    """What NCCL (which ignores tags) needs of every pair of ranks, skip messages included."""
    model, batch = gpt_and_batch(4)
    plan = lnn.parallelize(model, batch, "gpipe", 2, step="training_step", microbatches=2)
    check_message_order(plan.materialized, plan.program)  # the recipe's plan passes
    receiver = plan.materialized.ranks[1]
    boundary = [index for index, action in enumerate(receiver.actions) if isinstance(action, Recv) and action.boundary]
    first, second = (receiver.actions[index] for index in boundary[:2])
    receiver.actions[boundary[0]] = dataclasses.replace(first, tag=second.tag)
    receiver.actions[boundary[1]] = dataclasses.replace(second, tag=first.tag)
    with pytest.raises(PlanError, match=r"rank 0 sends rank 1 its messages in another order than rank 1 receives them"):
        check_message_order(plan.materialized, plan.program)


def test_stage_cuts_stay_balanced_when_one_boundary_is_much_lighter_than_the_blocks() -> None:
    """An MSA-heavy Evoformer: the hand-over between recycling passes crosses far fewer bytes than a
    block boundary; the cuts must still balance the cost (light is judged near each cut's target)."""
    torch.manual_seed(0)
    model = Evoformer(dataclasses.replace(EvoformerConfig.small(), recycles=3, n_seq=16, c_m=64))
    graph = lnn.trace(model, model.example_batch(8, torch.Generator().manual_seed(0)), step="training_step")
    stage_of = cut_stages(graph, 12, forward_only=8).stage_of
    costs = [sum(op_cost(op) for op in graph.ops if stage_of[op.name] == stage) for stage in range(12)]
    assert max(costs) <= 1.5 * sum(costs) / 12, [round(cost / sum(costs), 3) for cost in costs]


class LitAutoEncoder(torch.nn.Module):
    """Lightning's autoencoder example (``F.mse_loss``); ``worst=True`` trains on the largest squared error instead."""

    def __init__(self, worst: bool = False) -> None:
        super().__init__()
        self.worst = worst
        self.encoder = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        self.decoder = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.ReLU(), torch.nn.Linear(16, 64))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x = batch[0].view(batch[0].size(0), -1)
        x_hat = self.decoder(self.encoder(x))
        return (x_hat - x).pow(2).amax() if self.worst else torch.nn.functional.mse_loss(x_hat, x)


def test_the_docs_autoencoder_pipelines_its_mean_squared_error() -> None:
    """Capture writes ``F.mse_loss``'s mean as sum / count, so microbatches cut it as they cut a cross-entropy."""
    torch.manual_seed(0)
    batch = (torch.randn(8, 1, 8, 8), torch.zeros(8))
    plan = lnn.parallelize(LitAutoEncoder(), batch, "1f1b", 2, step="training_step")
    plan.verify()
    assert {"aten.mse_loss.default", "aten.div.Scalar"} <= {op.target for op in plan.graph.ops}


def test_an_op_the_batch_split_cannot_cut_is_refused_naming_it() -> None:
    """A loss that is the batch's largest error: each microbatch would have to read every other's."""
    torch.manual_seed(0)
    model, batch = LitAutoEncoder(worst=True), (torch.randn(8, 1, 8, 8), torch.zeros(8))
    lnn.parallelize(model, batch, "dp", 2, step="training_step").verify()  # not pipelined: fine
    with pytest.raises(ValueError, match=r"op 'amax' \(aten.amax.default\) cannot be split along the batch.*register_annotation"):
        lnn.parallelize(model, batch, "1f1b", 2, step="training_step")


def stage_modules(graph, cut) -> dict[int, list[str]]:
    """Per stage, the modules (``blocks.N`` or the parameter's key) whose parameters its ops read."""
    modules: dict[int, set[str]] = {}
    for op in graph.ops:
        for piece in op.tensor_inputs:
            key = graph.tensors[piece.name].state_key
            if graph.tensors[piece.name].role == "parameter":
                modules.setdefault(cut.stage_of[op.name], set()).add(".".join(key.split(".")[:2]) if key.startswith("blocks") else key)
    return {stage: sorted(names) for stage, names in sorted(modules.items())}


@pytest.mark.parametrize(
    ("layers_per_stage", "expected"),
    [
        ([1, 1, 1, 1], {0: ["blocks.0", "position_embedding.weight", "token_embedding.weight"], 1: ["blocks.1"], 2: ["blocks.2"],
                        3: ["blocks.3", "lm_head.weight", "ln_f.bias", "ln_f.weight"]}),
        ([0, 2, 2, 0], {0: ["position_embedding.weight", "token_embedding.weight"], 1: ["blocks.0", "blocks.1"],
                        2: ["blocks.2", "blocks.3"], 3: ["lm_head.weight", "ln_f.bias", "ln_f.weight"]}),
        ([3, 1], {0: ["blocks.0", "blocks.1", "blocks.2", "position_embedding.weight", "token_embedding.weight"],
                  1: ["blocks.3", "lm_head.weight", "ln_f.bias", "ln_f.weight"]}),
    ],
    ids=["one block each", "embeddings and head alone", "uneven"],
)
def test_layers_per_stage_puts_the_named_numbers_of_blocks_in_each_stage(layers_per_stage: list[int], expected: dict) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, seq_len=16, hidden=32, layers=4, heads=4))
    graph = lnn.trace(model, model.example_batch(8, torch.Generator().manual_seed(0)), step="training_step")
    assert stage_modules(graph, cut_stages(graph, len(layers_per_stage), layers_per_stage=layers_per_stage)) == expected


def test_a_pipeline_with_the_embeddings_and_the_head_on_stages_of_their_own_verifies() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, seq_len=16, hidden=32, layers=4, heads=4))
    plan = lnn.parallelize(model, model.example_batch(8, torch.Generator().manual_seed(0)), "1f1b", 4, step="training_step", layers_per_stage="0,2,2,0")
    plan.verify()


@pytest.mark.parametrize(
    ("layers_per_stage", "message"),
    [
        ("1,2", r"layers_per_stage \[1, 2\] must give 2 stages \(chunks\) and add up to the model.s 2 layers"),  # GPTConfig.small: 2 blocks
        ("2,0,0,0", r"only the first and the last stage may hold 0 layers"),
        ("1,x", r"recipe 'gpipe': parameter 'layers_per_stage' expects tuple\[int, \.\.\.\]: a list such as \[3, 3, 2\] or a "
                r"comma-separated string such as '3,3,2', got str '1,x'"),
        ("0,0", r"counts must be >= 0 and not all 0"),
    ],
)
def test_layers_per_stage_that_cannot_be_cut_is_refused_naming_it(layers_per_stage: str, message: str) -> None:
    model, batch = gpt_and_batch()
    stages = len(layers_per_stage.split(","))
    with pytest.raises(ValueError, match=message):
        lnn.parallelize(model, batch, "gpipe", stages, step="training_step", layers_per_stage=layers_per_stage, microbatches=stages)


@pytest.mark.parametrize(("recipe", "params"), [("1f1b", {"stages": 2, "microbatches": 2}), ("gpipe", {"stages": 2, "microbatches": 4})])
def test_a_loss_count_logged_per_replica_is_counted_where_the_loss_reads_the_targets(recipe: str, params: dict) -> None:
    """With 2 replicas the loss's count of kept targets is also logged per replica (a value no stage reads): it is
    counted in the last stage's prologue, beside the loss that reads the targets; stage 0 sends it neither the
    targets nor their mask (the last stages exchange only their counts, for the loss's mean over the batch)."""
    model, batch = gpt_and_batch()
    plan = lnn.parallelize(model, batch, recipe, 4, step="training_step", **params)
    assert any("_per_replica" in source for source in plan.sources)
    targets = plan.graph.user_inputs[1].name  # the batch is (tokens, targets)
    for rank, source in enumerate(plan.sources):
        prologue = source.split("def prologue(")[1].split("\ndef ")[0]
        sent = re.findall(r"comm\.send\(token, (\w+),", prologue)
        assert all("_count" in name for name in sent), f"rank {rank}'s prologue sends {sent}"  # only the counts the replicas exchange
        assert (f"held['{targets}']" in source) == (plan.pipeline.column_of_rank[rank] == 1), f"rank {rank}"
    plan.verify()
