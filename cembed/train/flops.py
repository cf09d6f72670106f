"""Model FLOPs per token, the device's peak, and MFU (model FLOPs utilisation) for the meter.

The FLOPs a training step needs, counted on real (non-padding) tokens only, for an encoder with
``N`` non-embedding parameters, ``L`` layers and attention width ``d`` (heads x head dim):

* a forward pass over a row of ``l`` real tokens costs ``2 N l`` in the weight matmuls (Kaplan et al.
  2020, "Scaling Laws for Neural Language Models", arXiv:2001.08361, section 2.1: ``C_forward ~ 2N``
  per token) plus ``4 L d l^2`` in attention (``QK^T`` and ``AV``, ``2 l d`` each per token and layer;
  Chowdhery et al. 2022, "PaLM", arXiv:2204.02311, appendix B, whose ``12 L H Q T`` per token is
  this forward term times 3; the encoder attends over the row's own ``l`` tokens in both directions);
* the backward pass costs twice the forward (Kaplan et al. 2020: training ``C ~ 6N`` per token);
* so a step costs ``passes x (2 N sum(l) + 4 L d sum(l^2))`` FLOPs over its rows, with ``passes``
  the forward-pass equivalents per row: 3 for a plain loss (forward + backward: ``6N`` per token)
  and 4 for a cached (GradCache) loss, which embeds every row once without gradients and replays
  the forward with the backward (``2N + 6N = 8N`` per token). PaLM's MFU leaves recomputation out;
  GradCache's first pass is counted here because the loss cannot do without it, so a cached run's
  MFU reads 4/3 of what a 6N convention would give.

Scoring. A multi-vector (late-interaction) model's MaxSim is work beyond the encoder that grows with
the batch squared: each query token meets each document token it is scored against in one dot product of
``D`` numbers, ``2 D`` FLOPs (the kind's :meth:`cembed.model.kinds.registry.ModelKind.scoring_flops`, the
forward; ``B^2 Lq Ld D`` multiply-adds for ``B`` queries against ``B`` documents). A training step of the
tiled loss (:mod:`cembed.model.maxsim`) costs :data:`SCORING_PASSES` = 4 such forwards: the forward, the
backward's recompute of the similarities (nothing of them is kept), and the backward's two products (the
gradients of the query and of the document tokens). :func:`scoring_flops` is that count; the meter
(:attr:`FlopModel.scoring_flops_per_pair` times the pairs the loss scored) and ``estimate`` both use it.
A chunk whose documents span several token tiles recomputes its similarities once more in the backward
(kernel work, not model work: not counted).

``N`` is transformers' ``PreTrainedModel.num_parameters(exclude_embeddings=True)`` (the ``N`` of its
own ``floating_point_ops``): all parameters except the ``nn.Embedding`` tables. Modules that act on
one vector per row (the BERT pooler, a Dense head) are counted per token too, which overstates the
FLOPs slightly (the pooler is ~1.4 % of all-MiniLM-L6-v2's ``N``). Padding, masked positions and
models with local attention windows (ModernBERT's alternate layers) are not modelled: the count is
the work the model needs, not the work the kernels did.

MFU is achieved model FLOP/s over the device's dense peak (PaLM, appendix B): bf16/fp16 tensor peak
for mixed precision, TF32 for fp32 with TF32 matmuls allowed, plain fp32 otherwise. The peaks are
NVIDIA's datasheet figures without sparsity (:data:`PEAKS`); ``train.peak_tflops`` overrides them.
On a CPU or an unknown GPU there is no peak and MFU is None.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

import torch

from cembed.plan.precision import uses_autocast

# Dense (no sparsity) peak TFLOP/s per GPU from NVIDIA's datasheets: (name pattern, part, bf16 =
# fp16 tensor with fp32 accumulate, TF32 tensor, fp32 non-tensor). Matched in order against
# torch.cuda.get_device_name(), case-insensitive: the more specific pattern first.
PEAKS: list[tuple[str, str, float | None, float | None, float]] = [
    (r"GB200", "GB200", 2500.0, 1250.0, 80.0),
    (r"B200", "B200", 2250.0, 1125.0, 75.0),
    (r"H200.*NVL", "H200 NVL", 835.5, 417.5, 60.0),
    (r"H200|GH200", "H200 SXM", 989.4, 494.7, 67.0),
    (r"H100.*NVL", "H100 NVL", 835.5, 417.5, 60.0),
    (r"H100.*PCIe", "H100 PCIe", 756.5, 378.0, 51.2),
    (r"H100|H800", "H100 SXM", 989.4, 494.7, 67.0),
    (r"A100|A800", "A100", 312.0, 156.0, 19.5),
    (r"L40S", "L40S", 362.05, 183.0, 91.6),
    (r"L40\b", "L40", 181.0, 90.5, 90.5),
    (r"\bL4\b", "L4", 121.0, 60.0, 30.3),
    (r"A10G", "A10G (A10's datasheet; NVIDIA publishes no A10G sheet)", 125.0, 62.5, 31.2),
    (r"A10\b", "A10", 125.0, 62.5, 31.2),
    (r"RTX 6000 Ada", "RTX 6000 Ada", 364.2, 182.1, 91.1),
    (r"RTX 4090", "GeForce RTX 4090", 165.2, 82.6, 82.6),
    (r"RTX 3090", "GeForce RTX 3090", 71.0, 35.6, 35.6),
    (r"V100", "V100 SXM2 (fp16 tensor; no bf16 or TF32)", None, None, 15.7),
    (r"\bT4\b", "T4 (fp16 tensor; no bf16 or TF32)", None, None, 8.1),
]
_FP16_ONLY = {"V100": 125.0, "T4": 65.0}  # fp16 tensor peaks of parts without bf16


def device_peak(name: str, precision: str) -> tuple[float | None, str]:
    """The dense peak of a GPU named ``name`` (``torch.cuda.get_device_name``) for ``precision``.

    Args:
        name: the device name, e.g. ``"NVIDIA H100 80GB HBM3"``.
        precision: ``"bf16"``, ``"fp16"``, ``"tf32"`` or ``"fp32"``.

    Returns:
        ``(peak FLOP/s or None, where it comes from)``; None for an unknown part or a precision the
        part has no tensor peak for.
    """
    for pattern, part, bf16, tf32, fp32 in PEAKS:
        if not re.search(pattern, name, flags=re.IGNORECASE):
            continue
        fp16_only = next((v for k, v in _FP16_ONLY.items() if part.startswith(k)), None)
        tflops = {"bf16": bf16, "fp16": fp16_only or bf16, "tf32": tf32, "fp32": fp32}.get(precision)
        if tflops is None:
            return None, f"{part}: no {precision} peak"
        return tflops * 1e12, f"{part} {precision} dense peak (NVIDIA datasheet)"
    return None, f"unknown GPU {name!r}: set train.peak_tflops (--peak-tflops) for MFU"


def format_flops(flops_per_s: float) -> str:
    """``flops_per_s`` with an SI prefix for display, e.g. ``"312 TFLOP/s"``, ``"6.18 MFLOP/s"``."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if flops_per_s >= factor:
            return f"{flops_per_s / factor:.3g} {prefix}FLOP/s"
    return f"{flops_per_s:.3g} FLOP/s"


def matmul_precision(precision: str, device: str) -> str:
    """The peak that bounds the run's matmuls: ``bf16``/``fp16`` as configured; for fp32 on CUDA
    ``tf32`` when TF32 matmuls are allowed (``torch.backends.cuda.matmul.allow_tf32``), else ``fp32``."""
    if uses_autocast(precision):
        return precision
    if device.startswith("cuda") and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "fp32"


@dataclass(frozen=True)
class FlopModel:
    """What the meter needs to turn token counts into model FLOPs (see the module docstring).

    Attributes:
        non_embedding_params: ``N``.
        layers: ``L`` (0: no attention term, for a model without a transformers config).
        attention_width: ``d`` = attention heads x head dimension.
        passes: forward-pass equivalents per row: 4 for a cached loss, 3 for a plain one.
        peak_flops: the device's dense peak in FLOP/s, or None (CPU, unknown GPU): MFU is then None.
        peak_source: where the peak comes from (datasheet part, ``train.peak_tflops``) or why none.
        scoring_flops_per_pair: training FLOPs per (query token, document token) pair a late-interaction
            loss scores (:func:`scoring_flops` of one pair; 0 for a dense model).
    """

    non_embedding_params: int
    layers: int
    attention_width: int
    passes: int
    peak_flops: float | None = None
    peak_source: str = "cpu: no peak"
    scoring_flops_per_pair: float = 0.0

    def flops(self, real_tokens: float, real_tokens_sq: float, scored_pairs: float = 0.0) -> float:
        """Model FLOPs for rows with ``sum(l) = real_tokens`` and ``sum(l^2) = real_tokens_sq``, and
        ``scored_pairs`` (query token, document token) pairs scored by a late-interaction loss:
        ``passes x (2 N sum(l) + 4 L d sum(l^2)) + scoring_flops_per_pair x scored_pairs``."""
        n, layers, width = self.non_embedding_params, self.layers, self.attention_width
        encoder = self.passes * (2.0 * n * real_tokens + 4.0 * layers * width * real_tokens_sq)
        return encoder + self.scoring_flops_per_pair * scored_pairs

    def to_dict(self) -> dict:
        """The model's constants and the formula, for ``run_summary.json``."""
        return {
            **asdict(self),
            "formula": "passes * (2 * N * sum(l) + 4 * L * d * sum(l^2)) over the real lengths l"
            + " + scoring_flops_per_pair * (query token, document token) pairs scored",
        }


def encoder_shape(model) -> tuple[int, int, int]:
    """``(N, L, d)`` of a SentenceTransformer's (or a transformers model's) encoder.

    ``N`` from ``num_parameters(exclude_embeddings=True)`` of the first module's ``auto_model``
    (else every parameter outside ``nn.Embedding`` modules); ``L`` and ``d`` from its config
    (``num_hidden_layers``, ``num_attention_heads`` x ``head_dim``, or ``hidden_size``), 0 when absent.
    """
    encoder = model
    try:
        encoder = getattr(model[0], "auto_model", model)
    except (TypeError, IndexError, KeyError):
        pass
    if hasattr(encoder, "num_parameters"):
        n = int(encoder.num_parameters(exclude_embeddings=True))
    else:
        embedded = {id(p) for m in encoder.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
        n = sum(p.numel() for p in encoder.parameters() if id(p) not in embedded)
    config = getattr(encoder, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    heads, head_dim = getattr(config, "num_attention_heads", None), getattr(config, "head_dim", None)
    width = int(heads * head_dim) if heads and head_dim else int(getattr(config, "hidden_size", 0) or 0)
    return n, layers, width


def model_shape(model) -> tuple[int, int, int]:
    """``(N, L, d)`` of the model a run trains: :func:`encoder_shape`'s, with ``N`` raised by the model
    kind's weights applied per token after the encoder (a multi-vector model's token projection:
    :meth:`cembed.model.kinds.registry.ModelKind.head_flops_per_token` / 2, as ``2 N`` counts a
    forward's FLOPs per token); a dense model's modules after pooling act once per row and are
    already counted per token in ``N`` (see the module docstring)."""
    from cembed.model.kinds.lookup import kind_of

    n, layers, width = encoder_shape(model)
    head = kind_of(model, default="dense").head_flops_per_token(model)  # a bare transformers model: none
    return n + int(head // 2), layers, width


SCORING_PASSES = 4  # the forward, the backward's recompute, its query and document products


def scoring_flops(model, query_tokens: float, document_tokens: float) -> float:
    """Training FLOPs of scoring ``query_tokens`` query tokens against ``document_tokens`` document tokens
    (every candidate a rank scores) in one step: :data:`SCORING_PASSES` x the model kind's forward
    scoring FLOPs (:meth:`cembed.model.kinds.registry.ModelKind.scoring_flops`; MaxSim:
    ``8 D x query_tokens x document_tokens``); 0 for a kind whose scoring is negligible (dense). The one
    formula of the meter and ``estimate`` (see the module docstring)."""
    from cembed.model.kinds.lookup import kind_of

    kind = kind_of(model, default="dense")
    return SCORING_PASSES * kind.scoring_flops(model, float(query_tokens), float(document_tokens))


def forward_passes(cached: bool) -> int:
    """Forward-pass equivalents per row of a step: 4 for a loss that caches gradients (a no-grad
    forward, then forward and backward), 3 for one forward/backward (a backward costs two forwards)."""
    return 4 if cached else 3


def build_flop_model(model, cached: bool, precision: str, device: str, peak_tflops: float | None = None) -> FlopModel:
    """The :class:`FlopModel` of a run.

    Args:
        model: the SentenceTransformer being trained.
        cached: the loss caches gradients (GradCache: 4 passes) rather than one forward/backward (3).
        precision: ``model.precision`` as resolved (``fp32``/``bf16``/``fp16``).
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:<i>"``; the peak is the current CUDA device's.
        peak_tflops: ``train.peak_tflops``: the peak in TFLOP/s per device, overriding the table.
    """
    n, layers, width = model_shape(model)
    passes = forward_passes(cached)
    if peak_tflops is not None:
        peak, source = peak_tflops * 1e12, "train.peak_tflops"
    elif device.startswith("cuda") and torch.cuda.is_available():
        peak, source = device_peak(torch.cuda.get_device_name(), matmul_precision(precision, device))
    else:
        peak, source = None, f"{device}: no peak (FLOP/s only)"
    return FlopModel(n, layers, width, passes, peak, source, scoring_flops(model, 1, 1))
