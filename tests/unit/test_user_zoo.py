"""The user zoo: modules written the way their own docs teach, planned with every tensor recipe.

Each module is a LightningModule whose ``training_step`` computes a loss (and logs what its docs log):
the Lightning docs autoencoder, PyTorch's nn.TransformerEncoder and nn.MultiheadAttention LMs, a
nanoGPT-style LM, a BatchNorm conv net, Hugging Face Llama / BERT / T5 built from tiny configs, a
timm ViT, a module creating tensors inside forward and one summing two losses. Each (module, recipe)
either verifies at 4 virtual ranks (``plan.verify()``: loss, gradients and logged values equal
single-device training) or is refused with a documented error whose message says why.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_nnscaler as lnn
from lightning_nnscaler.capture.trace import bind_inputs
from lightning_nnscaler.verify import evaluate

import lightning.pytorch as L  # noqa: E402 - after lightning_nnscaler

pytestmark = pytest.mark.usefixtures("one_thread")

WORLD_SIZE = 4
ROWS, LENGTH, VOCAB, HIDDEN, HEADS, FFN = 4, 8, 64, 32, 8, 64
RECIPES = ["dp", "tp", "sp", "coshard", "zero3"]
RECIPE_PARAMS: dict[str, dict[str, Any]] = {"coshard": {"shards": 2, "recompute": True}}


def tokens_and_targets(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of ``ROWS`` token sequences and their next-token targets."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (ROWS, LENGTH + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class LitAutoEncoder(L.LightningModule):
    """Lightning's docs autoencoder (the 15-minute introduction), on 28 x 28 images."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(28 * 28, 64), nn.ReLU(), nn.Linear(64, 3))
        self.decoder = nn.Sequential(nn.Linear(3, 64), nn.ReLU(), nn.Linear(64, 28 * 28))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, _ = batch
        x = x.view(x.size(0), -1)
        z = self.encoder(x)
        x_hat = self.decoder(z)
        loss = F.mse_loss(x_hat, x)
        self.log("train_loss", loss)
        return loss


class TransformerEncoderLM(L.LightningModule):
    """A causal LM from nn.TransformerEncoder, as PyTorch's language-modeling tutorial writes it."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, HIDDEN)
        layer = nn.TransformerEncoderLayer(HIDDEN, HEADS, FFN, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.size(1))
        hidden = self.encoder(self.embedding(tokens) * math.sqrt(HIDDEN), mask=mask, is_causal=True)
        return self.head(hidden)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        loss = F.cross_entropy(self(tokens).view(-1, VOCAB), targets.view(-1))
        self.log("train_loss", loss)
        return loss


class PreLNBlock(nn.Module):
    """A pre-LN block around nn.MultiheadAttention with a causal mask."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(HIDDEN)
        self.attn = nn.MultiheadAttention(HIDDEN, HEADS, dropout=0.0, batch_first=True)
        self.ln2 = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        normed = self.ln1(x)
        x = x + self.attn(normed, normed, normed, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class MultiheadAttentionLM(L.LightningModule):
    """A pre-LN LM of nn.MultiheadAttention blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, HIDDEN)
        self.position = nn.Embedding(LENGTH, HIDDEN)
        self.blocks = nn.ModuleList([PreLNBlock(), PreLNBlock()])
        self.ln = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        length = tokens.size(1)
        mask = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)
        x = self.embedding(tokens) + self.position(torch.arange(length))
        for block in self.blocks:
            x = block(x, mask)
        logits = self.head(self.ln(x))
        loss = F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))
        self.log("train_loss", loss)
        return loss


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention: one fused c_attn, split into q, k, v, then flash attention."""

    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.c_proj = nn.Linear(HIDDEN, HIDDEN)
        self.n_head, self.n_embd = HEADS, HIDDEN

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class NanoMLP(nn.Module):
    """nanoGPT's MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.c_fc = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class NanoBlock(nn.Module):
    """nanoGPT's block."""

    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(HIDDEN)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(HIDDEN)
        self.mlp = NanoMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(L.LightningModule):
    """nanoGPT (model.py) with weight tying, in a LightningModule."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, HIDDEN), wpe=nn.Embedding(LENGTH, HIDDEN),
            h=nn.ModuleList([NanoBlock() for _ in range(2)]), ln_f=nn.LayerNorm(HIDDEN),
        ))
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self(*batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss


class ConvNet(L.LightningModule):
    """A CIFAR-style conv net with BatchNorm2d that logs its loss and accuracy."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.classifier(self.features(x))
        loss = F.cross_entropy(logits, y)
        accuracy = (logits.argmax(dim=1) == y).float().mean()
        self.log("train_loss", loss)
        self.log("train_acc", accuracy, prog_bar=True)
        return loss


class HuggingFaceLM(L.LightningModule):
    """A Hugging Face model in a LightningModule: the model computes the loss from ``labels``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss


def llama(key_value_heads: int = HEADS, layers: int = 2) -> HuggingFaceLM:
    """LlamaForCausalLM from a tiny config (grouped-query attention where ``key_value_heads < HEADS``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=layers, num_attention_heads=HEADS,
        num_key_value_heads=key_value_heads, max_position_embeddings=32, attention_dropout=0.0, attn_implementation="sdpa",
    )
    return HuggingFaceLM(LlamaForCausalLM(config))


def bert() -> HuggingFaceLM:
    """BertForMaskedLM from a tiny config."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2, num_attention_heads=HEADS,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa",
    )
    return HuggingFaceLM(BertForMaskedLM(config))


def t5() -> HuggingFaceLM:
    """T5ForConditionalGeneration from a tiny config (its decoder inputs are the labels shifted right)."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=FFN, num_layers=1, num_decoder_layers=1, num_heads=HEADS,
        relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    )
    return HuggingFaceLM(T5ForConditionalGeneration(config))


class TimmClassifier(L.LightningModule):
    """A timm ViT (``timm.create_model``) classifying 32 x 32 images."""

    def __init__(self) -> None:
        super().__init__()
        import timm

        self.model = timm.create_model(
            "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=HIDDEN, depth=2, num_heads=HEADS,
            num_classes=10, drop_rate=0.0, attn_drop_rate=0.0, drop_path_rate=0.0,
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = F.cross_entropy(self.model(images), labels)
        self.log("train_loss", loss)
        return loss


class CreatesTensors(L.LightningModule):
    """An MLP LM whose forward creates tensors: torch.zeros, ones, arange and full."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rows, length = tokens.shape
        positions = torch.arange(length, dtype=torch.float32) / length
        bias = torch.zeros(rows, length, HIDDEN) + torch.ones(HIDDEN) * 0.5
        scale = torch.full((HIDDEN,), 2.0)
        hidden = self.embedding(tokens) * scale + bias + positions[None, :, None]
        return self.head(hidden + self.mlp(hidden))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        loss = F.cross_entropy(self(tokens).view(-1, VOCAB), targets.view(-1))
        self.log("train_loss", loss)
        return loss


class TwoLosses(L.LightningModule):
    """A classifier with an auxiliary reconstruction loss, summed, logging both."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.ReLU(), nn.Linear(FFN, HIDDEN))
        self.classifier = nn.Linear(HIDDEN, 10)
        self.decoder = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.ReLU(), nn.Linear(FFN, HIDDEN))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        z = self.encoder(x)
        classification = F.cross_entropy(self.classifier(z), y)
        reconstruction = F.mse_loss(self.decoder(z), x)
        self.log("classification_loss", classification)
        self.log("reconstruction_loss", reconstruction)
        loss = classification + 0.5 * reconstruction
        self.log("train_loss", loss)
        return loss


class PyTorchTransformerLM(L.LightningModule):
    """nn.Transformer (or nn.TransformerDecoder alone) as PyTorch's tutorial calls it: a causal ``tgt_mask`` from
    ``nn.Transformer.generate_square_subsequent_mask`` and no ``tgt_is_causal`` hint (torch then compares
    the mask's values with a causal one: ``capture.causal_masks``)."""

    def __init__(self, decoder_only: bool = False) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, HIDDEN)
        if decoder_only:
            layer = nn.TransformerDecoderLayer(HIDDEN, HEADS, FFN, dropout=0.0, batch_first=True)
            self.transformer: nn.Module = nn.TransformerDecoder(layer, num_layers=2)
        else:
            self.transformer = nn.Transformer(HIDDEN, HEADS, 1, 1, FFN, dropout=0.0, batch_first=True)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        tgt_mask = nn.Transformer.generate_square_subsequent_mask(tokens.size(1))
        x = self.embedding(tokens) * math.sqrt(HIDDEN)
        hidden = self.transformer(x, x, tgt_mask=tgt_mask)  # (source, target) for nn.Transformer, (target, memory) for the decoder
        loss = F.cross_entropy(self.head(hidden).view(-1, VOCAB), targets.view(-1))
        self.log("train_loss", loss)
        return loss


def gpt2() -> HuggingFaceLM:
    """GPT2LMHeadModel from a tiny config: q, k, v packed in one ``c_attn`` (a ``Conv1D``: addmm)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=HEADS, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, attn_implementation="sdpa",
    )
    return HuggingFaceLM(GPT2LMHeadModel(config))


def qwen2(key_value_heads: int = 2) -> HuggingFaceLM:
    """Qwen2ForCausalLM from a tiny config: rotary embeddings, grouped-query attention with ``key_value_heads``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2, num_attention_heads=HEADS,
        num_key_value_heads=key_value_heads, max_position_embeddings=32, attention_dropout=0.0, attn_implementation="sdpa",
    )
    return HuggingFaceLM(Qwen2ForCausalLM(config))


class TimmConvNeXt(L.LightningModule):
    """timm's ConvNeXt (``convnext_atto``: depthwise 7 x 7 convs, channels-last LayerNorms) on 32 x 32 images."""

    def __init__(self) -> None:
        super().__init__()
        import timm

        self.model = timm.create_model("convnext_atto", pretrained=False, num_classes=10, drop_path_rate=0.0)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = F.cross_entropy(self.model(images), labels)
        self.log("train_loss", loss)
        return loss


def images(channels: int, size: int, classes: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """``ROWS`` random images and labels."""
    generator = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, channels, size, size, generator=generator), torch.randint(0, classes, (ROWS,), generator=generator)


def hf_causal_batch() -> dict[str, torch.Tensor]:
    tokens, _ = tokens_and_targets()
    return {"input_ids": tokens, "labels": tokens.clone()}


def bert_batch() -> dict[str, torch.Tensor]:
    tokens, targets = tokens_and_targets()
    return {"input_ids": tokens, "labels": targets}


def t5_batch() -> dict[str, torch.Tensor]:
    tokens, targets = tokens_and_targets()
    return {"input_ids": tokens, "labels": targets}


def two_losses_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, HIDDEN, generator=generator), torch.randint(0, 10, (ROWS,), generator=generator)


def autoencoder_batch() -> tuple[torch.Tensor, torch.Tensor]:
    return images(1, 28)


ZOO: dict[str, tuple[Callable[[], nn.Module], Callable[[], Any]]] = {
    "autoencoder": (LitAutoEncoder, autoencoder_batch),
    "transformer_encoder": (TransformerEncoderLM, tokens_and_targets),
    "multihead_attention": (MultiheadAttentionLM, tokens_and_targets),
    "nanogpt": (NanoGPT, tokens_and_targets),
    "convnet": (ConvNet, lambda: images(3, 16)),
    "llama": (llama, hf_causal_batch),
    "llama_gqa": (lambda: llama(key_value_heads=HEADS // 2, layers=1), hf_causal_batch),
    "bert": (bert, bert_batch),
    "t5": (t5, t5_batch),
    "timm_vit": (TimmClassifier, lambda: images(3, 32)),
    "creates_tensors": (CreatesTensors, tokens_and_targets),
    "two_losses": (TwoLosses, two_losses_batch),
}


def build(name: str) -> tuple[nn.Module, Any]:
    """The zoo module ``name`` (seeded) and its example batch."""
    factory, batch = ZOO[name]
    torch.manual_seed(0)
    return factory(), batch()


LOGGED = {"convnet": ["train_loss", "train_acc"], "two_losses": ["classification_loss", "reconstruction_loss", "train_loss"]}

REFUSALS: dict[tuple[str, str], tuple[type[Exception], str]] = {
    # coshard cuts heads into 4 ranks x 2 shards = 8 parts; 4 key/value heads do not divide into 8.
    ("llama_gqa", "coshard"): (lnn.RecipeError, r"module model\.model\.layers\.0\.self_attn: view after k_proj, view after v_proj by dim 'c' of size 4 \(8 parts\)"),
}


@pytest.fixture(scope="module")
def zoo() -> Callable[[str], tuple[nn.Module, Any]]:
    """Each zoo module and batch, built once for all recipes."""
    built: dict[str, tuple[nn.Module, Any]] = {}

    def get(name: str) -> tuple[nn.Module, Any]:
        if name not in built:
            built[name] = build(name)
        return built[name]

    return get


@pytest.mark.timeout(300)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_module_verifies_or_is_refused_with_a_reason(name: str, recipe: str, zoo: Callable[[str], tuple[nn.Module, Any]]) -> None:
    module, batch = zoo(name)
    refusal = REFUSALS.get((name, recipe))
    if refusal is not None:
        error, message = refusal
        with pytest.raises(error, match=message):
            lnn.parallelize(module, batch, recipe, WORLD_SIZE, step="training_step", **RECIPE_PARAMS.get(recipe, {}))
        return
    plan = lnn.parallelize(module, batch, recipe, WORLD_SIZE, step="training_step", **RECIPE_PARAMS.get(recipe, {}))
    report = plan.verify()
    assert report.world_size == WORLD_SIZE and report.loss == pytest.approx(report.reference_loss, rel=1e-4)
    assert report.parameters_checked == sum(1 for parameter in module.parameters() if parameter.requires_grad)
    assert [logged_name for logged_name, _, _ in plan.logged.logs(report.values, 0)] == LOGGED.get(name, ["train_loss"])


def _verified(module: nn.Module, batch: Any, recipe: str, world_size: int, **params: Any) -> lnn.Plan:
    plan = lnn.parallelize(module, batch, recipe, world_size, step="training_step", **params)
    report = plan.verify()
    assert report.world_size == world_size and report.loss == pytest.approx(report.reference_loss, rel=1e-4)
    assert report.parameters_checked == sum(1 for parameter in module.parameters() if parameter.requires_grad)
    return plan


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("recipe", ["dp", "tp"])
@pytest.mark.parametrize("decoder_only", [False, True], ids=["transformer", "decoder"])
def test_pytorch_transformer_with_a_causal_tgt_mask_verifies(decoder_only: bool, recipe: str, world_size: int) -> None:
    torch.manual_seed(0)
    _verified(PyTorchTransformerLM(decoder_only), tokens_and_targets(), recipe, world_size)


PIPELINED: dict[str, tuple[Callable[[], nn.Module], Callable[[], Any]]] = {
    # cat of an empty key/value cache with the keys (GPT-2, Qwen2), rotary cat along head dims (Qwen2),
    # the loss's label shift (pad + slice), depthwise convs (ConvNeXt): all split by batch.
    "gpt2": (gpt2, hf_causal_batch),
    "qwen2": (qwen2, hf_causal_batch),
    "timm_convnext": (TimmConvNeXt, lambda: images(3, 32)),
    # BatchNorm takes statistics per microbatch (4 of one row here); verify's single device cuts it alike.
    "convnet": (ConvNet, lambda: images(3, 16)),
}


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:BatchNorm features.1, features.5. under a pipeline:UserWarning")
@pytest.mark.parametrize("recipe", ["1f1b", "gpipe", "interleaved", "zb1", "hybrid3d"])
@pytest.mark.parametrize("name", list(PIPELINED))
def test_user_model_pipelines_verify(name: str, recipe: str) -> None:
    """Every pipeline recipe (3f1b needs recycling passes these models do not have) plans and verifies them."""
    factory, batch = PIPELINED[name]
    torch.manual_seed(0)
    module = factory()
    params = {"dp": 1, "tp": 2, "pp": 2} if recipe == "hybrid3d" else {}
    plan = _verified(module, batch(), recipe, WORLD_SIZE, **params)
    assert plan.pipeline is not None and plan.pipeline.schedule.world_size == (2 if recipe == "hybrid3d" else WORLD_SIZE)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("recipe", ["1f1b", "gpipe"])
def test_batch_norm_under_a_pipeline_verifies_against_per_microbatch_statistics(recipe: str) -> None:
    """A pipeline normalizes each microbatch with its own statistics (``verify.replica_reference``): the plan verifies
    against one device whose BatchNorm is cut at the microbatches' rows, and differs from one device normalizing the
    whole batch at once."""
    torch.manual_seed(0)
    module = ConvNet()
    with pytest.warns(UserWarning, match=r"BatchNorm features\.1, features\.5: under a pipeline each microbatch"):
        plan = lnn.parallelize(module, images(3, 16), recipe, WORLD_SIZE, step="training_step")
    assert plan.pipeline.schedule.microbatches == ROWS  # one row each
    report = plan.verify()
    whole_batch = plan.graph  # BatchNorm over all ROWS rows, as one device without microbatches
    inputs = bind_inputs(plan.graph, module, images(3, 16), step="training_step")
    whole_loss = float(evaluate(whole_batch, inputs, backward_from=plan.graph.outputs[:1]).outputs[plan.graph.outputs[0]])
    assert report.loss == pytest.approx(report.reference_loss, rel=1e-5) and report.loss != pytest.approx(whole_loss, rel=1e-4)


PACKED_QKV = {
    # model, its packed projection's weight key and the box of output features part 0 (q) holds on rank 0 at tp 4
    "nanogpt": ("transformer.h.0.attn.c_attn.weight", 0),
    "gpt2": ("model.transformer.h.0.attn.c_attn.weight", 1),  # a Conv1D: the weight is (in, out)
    "timm_vit": ("model.blocks.0.attn.qkv.weight", 0),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(PACKED_QKV))
def test_packed_qkv_is_split_by_heads_under_tp(name: str) -> None:
    """q, k, v packed in one projection (split(E, dim=2), or reshape(B, N, 3, H, D)): each of 4 ranks holds
    a quarter of each of q, k and v (2 of 8 heads), three boxes of the one packed weight."""
    torch.manual_seed(0)
    module, batch = (gpt2(), hf_causal_batch()) if name == "gpt2" else build(name)
    plan = _verified(module, batch, "tp", WORLD_SIZE)
    key, features_dim = PACKED_QKV[name]
    boxes: dict[int, set[tuple[tuple[int, int], ...]]] = {}
    for op in plan.planned.ops:
        for piece in op.tensor_inputs:
            if piece.tensor.state_key == key:
                boxes.setdefault(op.device, set()).add(piece.index.ranges)
    assert sorted(boxes) == list(range(WORLD_SIZE))
    quarter = HIDDEN // WORLD_SIZE  # 2 heads of 4 features
    for rank, held in boxes.items():
        starts = sorted(box[features_dim][0] for box in held)
        assert starts == [part * HIDDEN + rank * quarter for part in range(3)]
        assert all(box[features_dim][1] - box[features_dim][0] == quarter and box[1 - features_dim] == (0, HIDDEN) for box in held)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("key_value_heads", "recipe", "params"), [(2, "tp", {}), (1, "hybrid", {"dp": 2, "tp": 2}), (1, "hybrid3d", {"dp": 1, "tp": 2, "pp": 2})],
)
def test_grouped_query_attention_keeps_each_kv_head_on_several_ranks(key_value_heads: int, recipe: str, params: dict[str, int]) -> None:
    """Qwen2 with fewer key/value heads than tensor-parallel ranks: as vLLM does, each kv head lives on
    tp / kv ranks, the one that rank's query heads read (its rows of k_proj), and the plan verifies."""
    torch.manual_seed(0)
    module = qwen2(key_value_heads)
    plan = lnn.parallelize(module, hf_causal_batch(), recipe, WORLD_SIZE, step="training_step", **params)
    report = plan.verify()
    assert report.loss == pytest.approx(report.reference_loss, rel=1e-4)
    assert report.parameters_checked == sum(1 for parameter in module.parameters() if parameter.requires_grad)
    tp = params.get("tp", WORLD_SIZE)
    head_size = HIDDEN // HEADS
    rows: dict[int, set[tuple[int, int]]] = {}
    for op in plan.planned.ops:
        for piece in op.tensor_inputs:
            if piece.tensor.state_key == "model.model.layers.0.self_attn.k_proj.weight":
                rows.setdefault(op.device, set()).add(piece.index.ranges[0])
    assert len(rows) == WORLD_SIZE // params.get("pp", 1)  # hybrid3d: layer 0 lives on the first stage's ranks
    for rank, held in rows.items():
        head = (rank % tp) * key_value_heads // tp
        assert held == {(head * head_size, (head + 1) * head_size)}
