"""Reference models: small configs train, are deterministic, and export the way capture does."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_nnscaler.models import (
    GPT,
    Evoformer,
    EvoformerConfig,
    GPTConfig,
    MBart,
    MBartConfig,
    Swin,
    SwinConfig,
)
from lightning_nnscaler.models._common import field_docs

MODELS = {
    "gpt": (GPT, GPTConfig),
    "swin": (Swin, SwinConfig),
    "mbart": (MBart, MBartConfig),
    "evoformer": (Evoformer, EvoformerConfig),
}
CONFIG_CLASSES = [GPTConfig, SwinConfig, MBartConfig, EvoformerConfig]


def build(name: str, seed: int = 0) -> tuple[nn.Module, tuple[Tensor, ...]]:
    """The small model of `name` and a batch of 2, both from `seed`; `log` is a no-op."""
    model_class, config_class = MODELS[name]
    torch.manual_seed(seed)
    model = model_class(config_class.small())
    model.log = lambda *args, **kwargs: None  # no Trainer attached
    batch = model.example_batch(2, generator=torch.Generator().manual_seed(seed))
    return model, batch


@pytest.mark.parametrize("name", list(MODELS))
def test_example_batch_is_a_valid_tuple_of_tensors(name: str) -> None:
    model, batch = build(name)
    assert isinstance(batch, tuple) and all(isinstance(tensor, Tensor) for tensor in batch)
    assert all(tensor.shape[0] == 2 for tensor in batch)
    config = model.config
    if name == "gpt":
        tokens, targets = batch
        assert tokens.shape == targets.shape == (2, config.seq_len)
        assert tokens.dtype == torch.int64 and tokens.min() >= 0 and tokens.max() < config.vocab_size
        assert torch.equal(tokens[:, 1:], targets[:, :-1])
    if name == "mbart":
        assert all(tensor.dtype == torch.int64 and tensor.max() < config.vocab_size for tensor in batch)
    if name == "swin":
        images, labels = batch
        assert images.shape == (2, 3, config.image_size, config.image_size)
        assert labels.max() < config.num_classes
    if name == "evoformer":
        msa_features, target_bins = batch
        assert msa_features.shape == (2, config.n_seq, config.n_res, config.msa_feat_dim)
        assert target_bins.shape == (2, config.n_res, config.n_res) and target_bins.max() < config.distogram_bins


@pytest.mark.parametrize("name", list(MODELS))
def test_training_step_gives_finite_loss_and_a_finite_grad_for_every_parameter(name: str) -> None:
    model, batch = build(name)
    loss = model.training_step(batch, 0)
    loss.backward()
    assert loss.dim() == 0 and torch.isfinite(loss)
    for parameter_name, parameter in model.named_parameters():
        assert parameter.requires_grad
        assert parameter.grad is not None, f"{parameter_name} got no gradient"
        assert torch.isfinite(parameter.grad).all(), f"{parameter_name} has a non-finite gradient"


@pytest.mark.parametrize("name", list(MODELS))
def test_small_config_is_cheap(name: str) -> None:
    # Counted, not timed: wall time on a shared CPU is noise. 100 MFLOP is ~10 ms on one core.
    model, batch = build(name)
    with FlopCounterMode(display=False) as flop_counter:
        model.training_step(batch, 0).backward()
    assert flop_counter.get_total_flops() < 100e6
    assert sum(parameter.numel() for parameter in model.parameters()) < 1e6


@pytest.mark.parametrize("name", list(MODELS))
def test_same_seed_gives_identical_loss(name: str) -> None:
    first_model, first_batch = build(name, seed=3)
    second_model, second_batch = build(name, seed=3)
    assert torch.equal(first_model.training_step(first_batch, 0), second_model.training_step(second_batch, 0))
    other_model, other_batch = build(name, seed=4)
    assert not torch.equal(first_model.training_step(first_batch, 0), other_model.training_step(other_batch, 0))


@pytest.mark.parametrize("name", list(MODELS))
def test_validation_step_and_optimizer(name: str) -> None:
    model, batch = build(name)
    logged: list[str] = []
    model.log = lambda key, value, *args, **kwargs: logged.append(key)
    with torch.no_grad():
        assert torch.isfinite(model.validation_step(batch, 0))
    model.training_step(batch, 0)
    assert logged == ["val_loss", "train_loss"]
    optimizer = model.configure_optimizers()
    assert isinstance(optimizer, torch.optim.AdamW)
    assert optimizer.defaults["lr"] == model.config.learning_rate == 1e-3


@pytest.mark.parametrize("config_class", CONFIG_CLASSES)
def test_config_is_keyword_only_frozen_and_documented(config_class: type) -> None:
    fields = dataclasses.fields(config_class)
    assert all(field.kw_only for field in fields)
    docs = field_docs(config_class)
    undocumented = [field.name for field in fields if not docs.get(field.name)]
    assert not undocumented, f"{config_class.__name__} fields without a docstring: {undocumented}"
    config = config_class.small()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.learning_rate = 0.1  # type: ignore[misc]
    with pytest.raises(TypeError):
        config_class(1)  # positional arguments are refused
    assert config.dropout == 0.0 and config.learning_rate == 1e-3
    assert isinstance(config_class.paper(), config_class)


def test_paper_and_named_presets_have_the_published_shapes() -> None:
    gpt3 = GPTConfig.paper()
    assert (gpt3.hidden, gpt3.layers, gpt3.heads, gpt3.seq_len, gpt3.ffn_hidden) == (4096, 32, 32, 2048, 16384)
    gpt2 = GPTConfig.gpt2_124m()
    assert (gpt2.vocab_size, gpt2.hidden, gpt2.layers, gpt2.heads, gpt2.seq_len) == (50257, 768, 12, 12, 1024)
    assert MBartConfig.paper().vocab_size == 250027 and MBartConfig.paper().ffn_hidden == 4096
    assert SwinConfig.paper().stage_resolutions == (56, 28, 14, 7)
    assert EvoformerConfig.paper().blocks == 48


def test_configs_reject_inconsistent_shapes_naming_the_key() -> None:
    with pytest.raises(ValueError, match="GPTConfig.heads"):
        GPTConfig(hidden=30, heads=4)
    with pytest.raises(ValueError, match="SwinConfig.window_size"):
        SwinConfig(image_size=40, patch_size=2, window_size=3, depths=(2,), heads=(1,))
    with pytest.raises(ValueError, match="pair_heads"):
        EvoformerConfig(c_z=10, pair_heads=4)


def test_gpt_is_causal() -> None:
    model, (tokens, _) = build("gpt")
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % model.config.vocab_size
    with torch.no_grad():
        assert torch.equal(model(tokens)[:, :-1], model(changed)[:, :-1])


def test_evoformer_recycling_passes_run_without_grad() -> None:
    torch.manual_seed(0)
    config = dataclasses.replace(EvoformerConfig.small(), recycles=3)
    model = Evoformer(config)
    calls: list[bool] = []
    model.blocks[0].register_forward_hook(lambda module, args, output: calls.append(torch.is_grad_enabled()))
    msa_features, _ = model.example_batch(1)
    model(msa_features)
    assert calls == [False, False, True]


class TrainingStep(nn.Module):
    """What capture exports: the model's training_step as forward(batch) -> loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: tuple[Tensor, ...]) -> Tensor:
        return self.model.training_step(batch, 0)


@pytest.mark.parametrize("name", list(MODELS))
def test_training_step_exports_non_strict(name: str) -> None:
    model, batch = build(name)
    exported = torch.export.export(TrainingStep(model), (batch,), strict=False)
    expected = model.training_step(batch, 0)
    assert torch.allclose(exported.module()(batch), expected, rtol=1e-5, atol=1e-6)
