"""Op cases: every distinct op call in the project's graphs, with the values it really receives.

The graphs are the reference models (GPT, Swin, MBart, Evoformer; their ``small()`` configs and
training steps) and five third-party models built from configs (Hugging Face GPT-2, BERT, T5; timm
Swin and ViT; dropout 0, nothing downloaded), plus an "op zoo" of the ops that have a rule but that
no model produces. Each graph is traced once and run through the reference interpreter while every
op's inputs are recorded; the calls reduce to one ``OpCase`` per distinct (target, annotation,
input shapes and dtypes, output shapes). An OpCase becomes a one-op ``Graph`` whose inputs are the
op's tensor inputs, so that ``op_trans`` can be checked on it in isolation (``check_split``).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

import lightning_nnscaler as lnn  # first: keeps torchvision (hence timm/transformers) importable
from lightning_nnscaler.ir.annotation import DimAnnotation
from lightning_nnscaler.ir.graph import Graph
from lightning_nnscaler.ir.interpret import assemble
from lightning_nnscaler.ir.op import Op, resolve_target

BATCH = 2
SEED = 0

# Ops whose results cannot be compared between two runs: random draws (a split changes them) and
# uninitialized memory. Dropout counts only with p > 0 (see ``is_uncomparable``).
UNCOMPARABLE_TARGETS = frozenset({
    "aten.bernoulli.p", "aten.bernoulli.default", "aten.rand_like.default", "aten.randn_like.default",
    "aten.rand.default", "aten.randn.default", "aten.randint.low", "aten.randperm.default",
    "aten.native_dropout.default", "aten.empty.memory_format", "aten.empty_like.default", "aten.new_empty.default",
})


class _LanguageModelLoss(nn.Module):
    """A Hugging Face model that computes its own loss from ``labels``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        labels = input_ids if labels is None else labels
        return self.model(input_ids=input_ids, labels=labels).loss


class _ClassifierLoss(nn.Module):
    """An image classifier plus cross-entropy."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(images), labels)


Built = tuple[nn.Module, Any, "str | None"]


def _reference(name: str) -> Built:
    from lightning_nnscaler import models

    model_class, config_class = {
        "gpt": (models.GPT, models.GPTConfig),
        "swin": (models.Swin, models.SwinConfig),
        "mbart": (models.MBart, models.MBartConfig),
        "evoformer": (models.Evoformer, models.EvoformerConfig),
    }[name]
    model = model_class(config_class.small())
    return model, model.example_batch(BATCH, generator=torch.Generator().manual_seed(SEED)), "training_step"


def _tokens(length: int, low: int = 0, seed: int = SEED) -> torch.Tensor:
    return torch.randint(low, 128, (BATCH, length), generator=torch.Generator().manual_seed(seed))


def _hf_gpt2() -> Built:
    import transformers

    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32,
        attn_pdrop=0, resid_pdrop=0, embd_pdrop=0, use_cache=False,
    )
    return _LanguageModelLoss(transformers.GPT2LMHeadModel(config)), (_tokens(16),), None


def _hf_bert() -> Built:
    import transformers

    config = transformers.BertConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0, attention_probs_dropout_prob=0,
    )
    return _LanguageModelLoss(transformers.BertForMaskedLM(config)), (_tokens(16),), None


def _hf_t5() -> Built:
    import transformers

    config = transformers.T5Config(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0,
        decoder_start_token_id=0, pad_token_id=0, use_cache=False,
    )
    # Labels shorter than the inputs: cross-attention is not square.
    return _LanguageModelLoss(transformers.T5ForConditionalGeneration(config)), (_tokens(16, low=1), _tokens(8, low=1, seed=1)), None


def _timm(name: str, **overrides: Any) -> Callable[[], Built]:
    def build() -> Built:
        import timm

        model = timm.create_model(name, pretrained=False, num_classes=10, **overrides)
        generator = torch.Generator().manual_seed(SEED)
        images = torch.randn(BATCH, 3, 32, 32, generator=generator)
        labels = torch.randint(0, 10, (BATCH,), generator=generator)
        return _ClassifierLoss(model), (images, labels), None

    return build


class _OpZoo(nn.Module):
    """Calls the ops that have a rule but that none of the models produce, so that those rules are
    checked too. Every result is summed into one scalar."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 12))
        self.conv = nn.Conv1d(12, 4, 3, padding=1)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x (4, 8, 12) floats, ids (4, 8) ints below 12."""
        scores = torch.bmm(x, x.transpose(1, 2))  # (4, 8, 8)
        products = [scores, torch.mm(x[0], self.weight.t()), torch.baddbmm(scores, x, x.transpose(1, 2), beta=0.5), self.conv(x.transpose(1, 2))]
        reductions = [
            x.var(dim=-1, keepdim=True), x.std(dim=1), torch.var(x, 1, correction=0), torch.std(x, -1, correction=2, keepdim=True),
            x.amax(-1, keepdim=True), x.amin(1), x.max(dim=-1)[0], x.min(dim=1)[1], x.argmax(-1), x.argmin(1),
            torch.logsumexp(x, dim=-1), torch.linalg.vector_norm(x, dim=-1), x.prod(dim=-1), x.mean(dim=-1),
            (x > 0).any(dim=-1), (x > -5).all(dim=1),
        ]
        along_a_dim = [
            torch.tril(scores), torch.triu(scores, 1), F.log_softmax(x, dim=-1), F.softmax(x, dim=1),
            torch.stack([part.sum(-1) for part in torch.split(x, [4, 8], dim=-1)], dim=-1), torch.chunk(x, 2, dim=1)[1],
            F.pad(x, (1, 3), value=1.0), F.pad(x, (2, 2)), torch.constant_pad_nd(x, [0, 0, 1, 1], 0.0), x.flip(0),
            F.nll_loss(F.log_softmax(x, -1).reshape(32, 12), ids.reshape(32), reduction="sum"),
        ]
        shapes = [x.reshape(4, 96).unflatten(1, (8, 12)), x[:, :1].squeeze(1), x[:, :, :1].squeeze(), x[:, :, :1].squeeze((2,)), x.type_as(ids)]
        elementwise = [
            torch.exp(-x.abs()), F.silu(x), torch.clamp(x, -1, 1), x.clamp_min(0), x.clamp_max(0), torch.sqrt(x.abs() + 1),
            torch.sin(x), torch.cos(x), torch.maximum(x, x.flip(0)), torch.minimum(x, -x), torch.where(x > 0, 1.0, x),
            x.abs().pow(x), 2 - x, F.softplus(x), F.elu(x), F.leaky_relu(x), F.mish(x), torch.erf(x), F.hardtanh(x),
            torch.reciprocal(x.abs() + 1), torch.floor(x), torch.ceil(x), torch.round(x), torch.sign(x), torch.log1p(x.abs()),
            x.masked_fill(x < 0, 0.5), torch.isnan(x), torch.logical_not(x > 0), (x > 0) & (x < 1) | (x > 2),
        ]
        factories = [x.new_full((4, 8), 2.0), torch.ones(4, 8), torch.full((4, 8), 3.0), torch.arange(2, 10), torch.arange(0, 16, 2)]
        return sum(result.float().sum() for result in products + reductions + along_a_dim + shapes + elementwise + factories)


def _op_zoo() -> Built:
    generator = torch.Generator().manual_seed(SEED)
    example = (torch.randn(4, 8, 12, generator=generator), torch.randint(0, 12, (4, 8), generator=generator))
    return _OpZoo(), example, None


MODELS: dict[str, Callable[[], Built]] = {
    "gpt": functools.partial(_reference, "gpt"),
    "swin": functools.partial(_reference, "swin"),
    "mbart": functools.partial(_reference, "mbart"),
    "evoformer": functools.partial(_reference, "evoformer"),
    "hf_gpt2": _hf_gpt2,
    "hf_bert": _hf_bert,
    "hf_t5": _hf_t5,
    "timm_swin": _timm(
        "swin_tiny_patch4_window7_224", img_size=32, patch_size=2, window_size=4, embed_dim=16,
        depths=(1, 1), num_heads=(1, 2), drop_path_rate=0.0,
    ),
    "timm_vit": _timm("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2),
}
MODEL_NAMES = tuple(MODELS)
ZOO = "op_zoo"
"""Not a model: the ops that have a rule but that no model produces. Its cases join the split checks."""
_BUILDERS = {**MODELS, ZOO: _op_zoo}


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """Run torch on one thread: these ops are tiny, and two threads per process fighting other
    processes for two cores made the checks five times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@functools.lru_cache(maxsize=None)
def traced(model_name: str) -> tuple[Graph, dict[str, torch.Tensor]]:
    """The model's graph and a value for each of its inputs (parameters, buffers, the batch)."""
    torch.manual_seed(SEED)
    module, example, step = _BUILDERS[model_name]()
    module.train()  # dropout is 0 everywhere; training mode is what a plan parallelizes
    graph = lnn.trace(module, example, step=step)
    inputs = {name: value.detach() for name, value in lnn.bind_inputs(graph, module, example, step=step).items()}
    return graph, inputs


@dataclass(frozen=True, eq=False)
class OpCase:
    """One op of a traced graph with the values of its tensor inputs (in ``op.tensor_inputs`` order)."""

    model: str
    op: Op
    values: tuple[torch.Tensor, ...]

    def __repr__(self) -> str:
        shapes = ", ".join(f"{value.dtype}{list(value.shape)}".removeprefix("torch.") for value in self.values)
        return f"OpCase({self.id} = {self.target}({shapes}) :: {self.op.annotation!r})"

    @property
    def target(self) -> str:
        """The op kind."""
        return self.op.target

    @property
    def id(self) -> str:
        """``model:op name``, e.g. ``gpt:linear_3``."""
        return f"{self.model}:{self.op.name}"

    @property
    def dims(self) -> DimAnnotation | None:
        """The op's parsed annotation."""
        return self.op.dims

    def call(self, values: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Run the op eagerly on other values for its tensor inputs; returns its outputs as a tuple."""
        args, kwargs = self.op.map_tensor_inputs(lambda position, _: values[position])
        result = resolve_target(self.op.target)(*args, **dict(kwargs))
        return tuple(result) if isinstance(result, (tuple, list)) else (result,)

    def graph(self) -> Graph:
        """A graph holding only this op: its tensor inputs are graph inputs, its outputs the outputs."""
        graph = Graph()
        for piece in self.op.tensor_inputs:
            tensor = piece.tensor
            if tensor.name not in graph.tensors:
                floating = tensor.dtype.startswith(("float", "bfloat", "complex"))
                # a box of a parameter (a packed projection's part, ``capture.packed_qkv``) is this graph's whole input
                graph.tensors[tensor.name] = replace(tensor, shape=piece.shape, role="input", state_key=None, requires_grad=floating)
                graph.inputs.append(tensor.name)
        args, kwargs = self.op.map_tensor_inputs(lambda _, piece: graph.tensors[piece.name].full())
        for output in self.op.outputs:
            graph.tensors[output.name] = output.tensor
            graph.outputs.append(output.name)
        graph.add_op(replace(self.op, args=args, kwargs=kwargs, device=None, origin=None))
        return graph

    @property
    def values64(self) -> tuple[torch.Tensor, ...]:
        """The recorded values with floating tensors in float64 (integer tensors as they are)."""
        return tuple(value.double() if value.is_floating_point() else value for value in self.values)

    def inputs(self) -> dict[str, torch.Tensor]:
        """A value for each input of ``graph()``: the recorded one, floating tensors in float64.

        Double precision keeps the checks' tolerance (rtol 1e-5) about the split alone: in float32
        a split batch sums a weight gradient in another order, which moves it by ~1e-5 already.
        """
        return {piece.name: value for piece, value in zip(self.op.tensor_inputs, self.values64)}

    def split_choices(self) -> list[str]:
        """What ``op_trans`` may split this op by: its splittable dim names, then ``"value"`` if allowed."""
        dims = self.dims
        if dims is None:
            return []
        return dims.splittable_names() + (["value"] if dims.value_inputs else [])

    def name_sizes(self) -> dict[str, int]:
        """Size of each dim name of the annotation."""
        assert self.dims is not None
        return self.dims.name_sizes([piece.shape for piece in self.op.tensor_inputs], [out.shape for out in self.op.outputs])

    def allows(self, choice: str, parts: int) -> bool:
        """Whether ``parts`` divides the dim (a value split always divides)."""
        return choice == "value" or self.name_sizes()[choice] % parts == 0

    def allowed_splits(self, parts_options: tuple[int, ...] = (2, 4)) -> list[tuple[str, int]]:
        """Every ``(choice, parts)`` the annotation allows and the sizes divide."""
        return [(choice, parts) for choice in self.split_choices() for parts in parts_options if self.allows(choice, parts)]


def is_uncomparable(op: Op) -> bool:
    """Whether the op's result varies from run to run (dropout with ``p > 0`` included)."""
    if op.target in UNCOMPARABLE_TARGETS:
        return True
    if op.target == "aten.dropout.default":
        probability = op.args[1] if len(op.args) > 1 else op.kwargs_dict.get("p", 0.0)
        train = op.args[2] if len(op.args) > 2 else op.kwargs_dict.get("train", True)
        return bool(train) and probability > 0
    return False


def _recorded(graph: Graph, inputs: dict[str, torch.Tensor]) -> list[tuple[Op, tuple[torch.Tensor, ...]]]:
    """Run the graph op by op (as the interpreter does) and keep each op's input values."""
    pieces: dict[str, list[Any]] = {}
    for name in graph.inputs:
        value = inputs.get(name, graph.constant_values.get(name))
        pieces[name] = [(graph.tensors[name].full(), value)]
    recorded = []
    with torch.no_grad():
        for op in graph.ops:
            values = tuple(assemble(pieces, piece, reader=op.name) for piece in op.tensor_inputs)
            args, kwargs = op.map_tensor_inputs(lambda position, _: values[position])
            result = resolve_target(op.target)(*args, **dict(kwargs))
            results = result if isinstance(result, (tuple, list)) else (result,)
            for output, value in zip(op.outputs, results, strict=True):
                pieces.setdefault(output.name, []).append((output, value))
            recorded.append((op, tuple(value.detach().clone() for value in values)))
    return recorded


def _case_key(op: Op) -> tuple[Any, ...]:
    # Output shapes too: a factory (arange, zeros) has no tensor input to tell its calls apart.
    inputs = op.tensor_inputs
    return (
        op.target, op.annotation, tuple(piece.shape for piece in inputs), tuple(piece.tensor.dtype for piece in inputs),
        tuple(output.shape for output in op.outputs),
    )


@functools.lru_cache(maxsize=None)
def model_op_cases(model_name: str) -> tuple[OpCase, ...]:
    """The distinct op calls of one model's graph (ops whose results cannot be compared left out)."""
    graph, inputs = traced(model_name)
    cases: dict[tuple[Any, ...], OpCase] = {}
    with single_threaded():
        recorded = _recorded(graph, inputs)
    for op, values in recorded:
        if not is_uncomparable(op):
            cases.setdefault(_case_key(op), OpCase(model_name, op, values))
    return tuple(cases.values())


@functools.lru_cache(maxsize=None)
def all_op_cases(with_zoo: bool = False) -> tuple[OpCase, ...]:
    """The distinct op calls of all graphs (and the zoo's); a call seen in several is kept once (first)."""
    cases: dict[tuple[Any, ...], OpCase] = {}
    for model_name in MODEL_NAMES + ((ZOO,) if with_zoo else ()):
        for case in model_op_cases(model_name):
            cases.setdefault(_case_key(case.op), case)
    return tuple(cases.values())


def cases_by_target(with_zoo: bool = False) -> dict[str, list[OpCase]]:
    """``all_op_cases()`` grouped by op target, targets sorted."""
    grouped: dict[str, list[OpCase]] = {}
    for case in all_op_cases(with_zoo):
        grouped.setdefault(case.target, []).append(case)
    return dict(sorted(grouped.items()))


def all_targets() -> dict[str, list[str]]:
    """Every op target of every graph, with the models whose graphs use it (random ops included)."""
    targets: dict[str, list[str]] = {}
    for model_name in MODEL_NAMES:
        graph, _ = traced(model_name)
        for op in graph.ops:
            models = targets.setdefault(op.target, [])
            if model_name not in models:
                models.append(model_name)
    return dict(sorted(targets.items()))


# --- checks -------------------------------------------------------------------------------------


def split_plan(case: OpCase, choice: str, parts: int) -> Graph:
    """The one-op graph with its op split by ``choice`` into ``parts`` pieces on devices 0..parts-1."""
    plan = case.graph()
    for device, piece in enumerate(lnn.op_trans(plan, plan.ops[0], choice, parts)):
        lnn.op_assign(plan, piece, device)
    return plan


def check_split(case: OpCase, choice: str, parts: int) -> None:
    """Raise unless splitting the op by ``choice`` into ``parts`` keeps its outputs and gradients.

    Beyond ``assert_equivalent`` (outputs, and input gradients through the first output), this
    checks the input gradients through every output of a multi-output op, and, for a split that
    leaves value parts, that the op really is linear in its value inputs: the interpreter hands
    value part 0 the whole input and the other parts zeros, which only proves ``f(0) == 0``.
    """
    reference, plan = case.graph(), split_plan(case, choice, parts)
    lnn.assert_equivalent(reference, plan, case.inputs())
    if len(case.op.outputs) > 1:
        _assert_close(_all_output_gradients(reference, case.inputs()), _all_output_gradients(plan, case.inputs()), "gradient of")
    dims = case.dims
    if dims is not None and (choice == "value" or choice in dims.reduced) and dims.value_inputs:
        check_linearity(case)


@functools.lru_cache(maxsize=None)  # once per case: it does not depend on the split
def check_linearity(case: OpCase, seed: int = SEED) -> None:
    """Raise unless ``f(x) == f(r) + f(x - r)`` for random ``r`` in the annotation's value inputs, jointly."""
    dims = case.dims
    assert dims is not None
    generator = torch.Generator().manual_seed(seed)
    values = case.values64
    first, second = list(values), list(values)
    for position in dims.value_inputs:
        value = values[position]
        if value.dtype == torch.bool:
            raise AssertionError(f"{case.id}: value input {position} is a bool tensor, which has no partial sums")
        if value.is_floating_point():
            share = torch.randn(value.shape, generator=generator, dtype=value.dtype)
        else:
            share = torch.randint(-100, 100, value.shape, generator=generator, dtype=value.dtype)
        first[position], second[position] = share, value - share
    whole = case.call(values)
    halves = [a + b for a, b in zip(case.call(first), case.call(second))]
    _assert_close(dict(enumerate(whole)), dict(enumerate(halves)), f"{case.id}: value parts of output")


def _all_output_gradients(graph: Graph, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    leaves = {name: value.detach().clone().requires_grad_(value.is_floating_point()) for name, value in inputs.items()}
    outputs = lnn.run_graph(graph, leaves)
    generator = torch.Generator().manual_seed(SEED)
    total = sum(
        (value * torch.randn(value.shape, generator=generator, dtype=value.dtype)).sum()
        for value in outputs.values()
        if value.requires_grad
    )
    if isinstance(total, torch.Tensor):
        total.backward()
    return {name: leaf.grad for name, leaf in leaves.items() if leaf.grad is not None}


def _assert_close(expected: dict[Any, torch.Tensor], actual: dict[Any, torch.Tensor], what: str) -> None:
    assert expected.keys() == actual.keys(), f"{what}: {sorted(map(str, expected))} vs {sorted(map(str, actual))}"
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=1e-5, atol=1e-5, equal_nan=True, msg=lambda m, key=key: f"{what} {key}: {m}")


def coverage_table() -> str:
    """One row per op target of the graphs: models using it, calls, distinct cases, an annotation."""
    calls: dict[str, int] = {}
    examples: dict[str, str | None] = {}
    for model_name in MODEL_NAMES:
        for op in traced(model_name)[0].ops:
            calls[op.target] = calls.get(op.target, 0) + 1
            examples.setdefault(op.target, op.annotation)
    cases = {target: len(group) for target, group in cases_by_target().items()}
    header = ("target", "graphs", "calls", "cases", "annotation (first call)")
    rows = [header] + [
        (target, str(len(models)), str(calls[target]), str(cases.get(target, 0)), repr(examples[target]))
        for target, models in all_targets().items()
    ]
    widths = [max(len(row[column]) for row in rows) for column in range(len(header) - 1)]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1] for row in rows)
