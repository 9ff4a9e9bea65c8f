"""Published per-GPU throughput of large training runs, the calibration set of the analytic cluster model
(``benchmarks/simulator_paper_scale.py``). Every published figure carries its source (paper and table, or the
repository file and commit it was read from); what a row needed beyond the publication is in its assumption
fields (``microbatch``, ``virtual_stages``, ``recompute`` ...) and said so in ``assumed``.

Sources:

- ``NARAYANAN``: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM" (SC21, arXiv 2104.04473), Table 1: GPT models on Selene (DGX A100 80 GB, 8 HDR NICs per node),
  vocab 51,200, 2048 tokens; t, p, GPUs, batch and achieved teraFLOP/s per GPU. Read from the same table in the
  Megatron-LM README's ``images/cases_april2021.png`` (NVIDIA/Megatron-LM at 937571cfd4^, July 2024), which
  gives the model-parallel size t·p; the t / p split (t = 8 from 18B on) is the paper's. Its FLOPs count
  (the paper's eq. 3) includes the recomputed forward: ``96·B·s·l·h²·(1 + s/6h + V/16lh)``.
- ``BLOOM``: BigScience 2022, BLOOM 176B ("BLOOM: A 176B-Parameter Open-Access Multilingual Language Model",
  arXiv 2211.05100, its engineering section; and the BigScience 176B model page): 384 A100 80 GB (Jean Zay, 48 nodes), one model
  copy on 48 GPUs (tp 4 × pp 12, dp 8), 70 layers, hidden 14,336, 112 heads, 2048 tokens, vocab 250,680, batch
  2048 sequences; "about 150 TFLOPs" per GPU (Megatron-DeepSpeed's count, eq. 3 with recompute).
- ``MEGATRON_H100``: the Megatron-LM README's weak-scaling table (``images/model_table.png``, NVIDIA/Megatron-LM
  at 937571cfd4, "Updated README with new scaling figures on H100 GPUs", Megatron-Core r0.8.0, 2024): GPT models,
  vocab 131,072, 4096 tokens, dp 48, per-GPU teraFLOP/s as model FLOPs (MFU), with "--overlap-grad-reduce,
  --overlap-param-gather, --tp-comm-overlap" (the README's benchmark configuration). FLOPs: Megatron's
  ``num_floating_point_operations`` at that commit (``megatron/training/training.py``).
- ``LLAMA3``: Dubey et al. 2024, "The Llama 3 Herd of Models" (arXiv 2407.21783), Table 4: Llama 3 405B on
  8,192 and 16,384 H100s, tp 8, cp 1, pp 16, 8,192 tokens, 16M tokens per batch, 430 and 400 TFLOPs/GPU (43 % /
  41 % BF16 MFU); the model: 126 layers, hidden 16,384, FFN 53,248 (SwiGLU), 128 heads, 8 KV heads, vocab
  128,256 (Table 3). The 16,384-GPU row with cp 16 (131k tokens) is left out: the model has no context
  parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

NARAYANAN = "Narayanan et al. 2021 (SC21), Table 1"
BLOOM = "BigScience 2022 (BLOOM, arXiv 2211.05100; BigScience 176B model page)"
MEGATRON_H100 = "Megatron-LM README, model_table.png (937571cfd4, Megatron-Core r0.8.0)"
LLAMA3 = "Dubey et al. 2024 (Llama 3), Table 4"


@dataclass(frozen=True)
class PublishedRun:
    """One published run: its configuration and per-GPU throughput as published, and what predicting it assumed.

    ``flops``: how the source counts a step's FLOPs (``"eq3"``: Narayanan et al.'s eq. 3 with the recomputed
    forward; ``"megatron"``: Megatron's model FLOPs). ``noise``: the share by which the published figure may be
    off (rounding, run-to-run spread); pairs closer than their noise are left out of the ranking check.
    """

    name: str
    gpu: str
    source: str
    gpus: int
    tp: int
    pp: int
    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    global_batch: int
    tflops: float
    flops: str
    # assumptions (not published for the row; see ``assumed``)
    microbatch: int = 1
    virtual_stages: int = 1
    recompute: str = "full"
    sequence_parallel: bool = False
    zero1: bool = False
    overlap_grad_reduce: bool = False
    overlap_tp_comm: bool = False
    simulated_layers: int = 0
    embeddings: bool = True
    ffn_hidden: int = 0
    kv_heads: int = 0
    swiglu: bool = False
    noise: float = 0.02
    assumed: str = ""

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    def step_flops(self) -> float:
        """FLOPs of one step as the source counts them (see ``flops``)."""
        b, s, l, h, v = self.global_batch, self.seq_len, self.layers, self.hidden, self.vocab
        if self.flops == "eq3":  # Narayanan et al. 2021, eq. 3
            return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
        groups = self.kv_heads or self.heads  # Megatron's num_floating_point_operations (q projection = h)
        ffn = (self.ffn_hidden or 4 * h) / h * (1.5 if self.swiglu else 1.0)
        return 12 * b * s * l * h * h * ((1 + groups / self.heads + s / h) + ffn + v / (2 * l * h))

    def published_step_seconds(self) -> float:
        """The step time the published per-GPU throughput implies under the source's FLOPs count."""
        return self.step_flops() / (self.gpus * self.tflops * 1e12)


_NARAYANAN_ASSUMED = "microbatch 1, plain 1F1B (v 1), full recompute, no sp / ZeRO-1 / overlap (Megatron of 2021)"
_A100 = dict(gpu="a100", source=NARAYANAN, seq_len=2048, vocab=51200, flops="eq3", assumed=_NARAYANAN_ASSUMED)
_H100_ASSUMED = ("microbatch 1, interleaved with 2 blocks per chunk (1 where a rank's blocks are odd), selective "
                 "recompute + sp, ZeRO-1 with overlapped gradient reduction and tp communication (the README's --overlap-* "
                 "and --tp-comm-overlap flags)")
_H100 = dict(gpu="h100", source=MEGATRON_H100, seq_len=4096, vocab=131072, flops="megatron", recompute="selective",
             sequence_parallel=True, zero1=True, overlap_grad_reduce=True, overlap_tp_comm=True, assumed=_H100_ASSUMED)
_LLAMA_ASSUMED = ("126 layers simulated as 128 uniform blocks of 12·h² (Llama 3 drops a layer from the first and last "
                  "stages for the embedding and head, §3.3.2; its GQA + SwiGLU block has 11.9·h²) without the "
                  "embedding / head; microbatch 1, interleaved v 4, selective recompute + sp, ZeRO-1, overlapped "
                  "gradient reduction; FLOPs counted as Megatron counts them for this architecture")
_LLAMA = dict(gpu="h100", source=LLAMA3, tp=8, pp=16, layers=126, hidden=16384, heads=128, seq_len=8192, vocab=128256,
              flops="megatron", ffn_hidden=53248, kv_heads=8, swiglu=True, recompute="selective", sequence_parallel=True,
              zero1=True, overlap_grad_reduce=True, virtual_stages=4, simulated_layers=128, embeddings=False,
              assumed=_LLAMA_ASSUMED)

RUNS: list[PublishedRun] = [
    PublishedRun("GPT 1.7B", gpus=32, tp=1, pp=1, layers=24, hidden=2304, heads=24, global_batch=512, tflops=137, **_A100),
    PublishedRun("GPT 3.6B", gpus=64, tp=2, pp=1, layers=30, hidden=3072, heads=32, global_batch=512, tflops=138, **_A100),
    PublishedRun("GPT 7.5B", gpus=128, tp=4, pp=1, layers=36, hidden=4096, heads=32, global_batch=512, tflops=142, **_A100),
    PublishedRun("GPT 18.4B", gpus=256, tp=8, pp=1, layers=40, hidden=6144, heads=48, global_batch=1024, tflops=135, **_A100),
    PublishedRun("GPT 39.1B", gpus=512, tp=8, pp=2, layers=48, hidden=8192, heads=64, global_batch=1536, tflops=138, **_A100),
    PublishedRun("GPT 76.1B", gpus=1024, tp=8, pp=4, layers=60, hidden=10240, heads=80, global_batch=1792, tflops=140, **_A100),
    PublishedRun("GPT 145.6B", gpus=1536, tp=8, pp=8, layers=80, hidden=12288, heads=96, global_batch=2304, tflops=148, **_A100),
    PublishedRun("GPT 310.1B", gpus=1920, tp=8, pp=16, layers=96, hidden=16384, heads=128, global_batch=2160, tflops=155, **_A100),
    PublishedRun("GPT 529.6B", gpus=2520, tp=8, pp=35, layers=105, hidden=20480, heads=128, global_batch=2520, tflops=163, **_A100),
    PublishedRun("GPT 1008B", gpus=3072, tp=8, pp=64, layers=128, hidden=25600, heads=160, global_batch=3072, tflops=163, **_A100),
    PublishedRun("BLOOM 176B", gpu="a100", source=BLOOM, gpus=384, tp=4, pp=12, layers=70, hidden=14336, heads=112, seq_len=2048,
                 vocab=250680, global_batch=2048, tflops=150, flops="eq3", microbatch=2, zero1=True, simulated_layers=72,
                 embeddings=False, noise=0.05,
                 assumed="70 layers simulated as 72 (6 per stage) without the embedding / head; microbatch 2, full "
                         "recompute, ZeRO-1, plain 1F1B; Jean Zay's Omni-Path priced as the A100 spec's InfiniBand"),
    PublishedRun("GPT 1.7B", gpus=48, tp=1, pp=1, layers=24, hidden=2048, heads=16, global_batch=192, tflops=408.8, **_H100),
    PublishedRun("GPT 7.1B", gpus=96, tp=2, pp=1, layers=30, hidden=4096, heads=32, global_batch=192, tflops=465.9, **_H100),
    PublishedRun("GPT 16B", gpus=192, tp=4, pp=1, layers=32, hidden=6144, heads=48, global_batch=192, tflops=489.1, **_H100),
    PublishedRun("GPT 32B", gpus=384, tp=8, pp=1, layers=48, hidden=7168, heads=56, global_batch=192, tflops=459.6, **_H100),
    PublishedRun("GPT 70B", gpus=768, tp=8, pp=2, layers=84, hidden=8192, heads=64, global_batch=384, tflops=419.7,
                 virtual_stages=21, **_H100),
    PublishedRun("GPT 119B", gpus=1536, tp=8, pp=4, layers=92, hidden=10240, heads=80, global_batch=768, tflops=420.5,
                 virtual_stages=23, **_H100),
    PublishedRun("GPT 177B", gpus=2304, tp=8, pp=6, layers=96, hidden=12288, heads=96, global_batch=1152, tflops=432.8,
                 virtual_stages=8, **_H100),
    PublishedRun("GPT 314B", gpus=3072, tp=8, pp=8, layers=96, hidden=16384, heads=128, global_batch=1536, tflops=474.4,
                 virtual_stages=6, **_H100),
    PublishedRun("GPT 462B", gpus=6144, tp=8, pp=16, layers=112, hidden=18432, heads=144, global_batch=3072, tflops=459.9,
                 virtual_stages=7, **_H100),
    PublishedRun("Llama 3 405B", gpus=8192, global_batch=2048, tflops=430, **_LLAMA),
    PublishedRun("Llama 3 405B", gpus=16384, global_batch=2048, tflops=400, **_LLAMA),
]
"""The calibration set, in source order; ``simulator_paper_scale.held_out`` holds out every third row per GPU."""
