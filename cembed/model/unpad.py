"""Unpadded attention: a cached-loss mini-batch's rows packed into sequences without padding.

Padded, a mini-batch runs the encoder on ``rows x longest`` positions. Packed, the rows lie end to
end in a few sequences ("packs"), each token keeps its position within its row (``position_ids``)
and a block-diagonal attention mask keeps each row attending to itself only, so every token's
output equals the padded path's (to float rounding) and no position is padding.

By composition with sentence-transformers (no copy of its modules' code): during one mini-batch's
forward (:func:`packed_encoder`) a forward pre-hook on the model's first module, the
``Transformer``, hands it the packed inputs; it runs its transformers model (``auto_model``) on
them; a forward hook scatters the token embeddings back to the padded ``(rows, longest, dim)``
layout, and the model's own remaining modules (``Pooling``, ``Normalize``...) run on that. The hooks
live inside the model's forward, so a DDP-wrapped model is called as before.

Which models (:func:`resolve_unpad`): a ``Transformer`` whose model takes ``position_ids`` and runs
``sdpa`` or ``eager`` attention (both take a prepared 4D mask as is, see
``transformers.masking_utils``), whose config declares only full attention within a row (the 4D mask
replaces the model's own, so a sliding window or local blocks would silently widen to the whole row),
confirmed at start-up by embedding rows of up to ~100 tokens, several per pack, packed and each alone.
Flash attention ignores a 4D mask; relative-position models, causal decoders (the mask is
bidirectional within a row) and local attention fall back to sorted padding, saying why.

Packing plans (which rows share a pack, the index tensors): :mod:`cembed.model.packing`.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import torch

from cembed.errors import ModelRefused, first_line
from cembed.model.packing import PackPlan, attention_cost, plan_packing

# Keys a packed column may carry besides its per-token tensors: sentence-transformers' bookkeeping.
_PASSTHROUGH_KEYS = frozenset({"modality", "prompt_length", "task"})

UnpadSetting = Literal["auto", True, False]


@dataclass(frozen=True)
class Unpadding:
    """Whether a loss packs its mini-batches, and how (:func:`resolve_unpad`'s answer).

    Attributes:
        enabled: mini-batches are packed.
        description: one line for ``validate``, the run header and ``run_summary.json``.
        mask: ``bool`` (sdpa: True = attend) or ``additive`` (eager: 0 / dtype minimum).
        position_offset: added to each row's positions (RoBERTa-style tables start after padding_idx).
        cost_per_width: :func:`attention_cost` of the model.
    """

    enabled: bool
    description: str
    mask: Literal["bool", "additive"] = "bool"
    position_offset: int = 0
    cost_per_width: float = 0.0

    def to_dict(self) -> dict:
        """``{"unpadded": bool, "path": description}`` for ``run_summary.json``."""
        return {"unpadded": self.enabled, "path": self.description}


def _first_module(model):
    model = getattr(model, "module", model)  # DDP
    model = getattr(model, "_orig_mod", model)  # torch.compile
    return model[0]


def _block_mask(plan: PackPlan, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """``(packs, 1, pack_width, pack_width)``: a position attends to the positions of its own row
    (and the positions after a pack's last row to each other, so no softmax row is empty)."""
    seg = plan.segments
    same = seg[:, None, :, None] == seg[:, None, None, :]
    if kind == "bool":
        return same
    return torch.zeros(same.shape, dtype=dtype, device=same.device).masked_fill_(~same, torch.finfo(dtype).min)


def _pack_tensor(value: torch.Tensor, plan: PackPlan) -> torch.Tensor:
    flat = value.reshape(plan.rows * plan.width, *value.shape[2:])
    return flat.index_select(0, plan.gather).view(plan.packs, plan.pack_width, *value.shape[2:])


def _unpack_tensor(value: torch.Tensor, plan: PackPlan, keep: torch.Tensor) -> torch.Tensor:
    flat = value.reshape(plan.packs * plan.pack_width, *value.shape[2:])
    out = flat.index_select(0, plan.scatter).view(plan.rows, plan.width, *value.shape[2:])
    return torch.where(keep.view(plan.rows, plan.width, *([1] * (value.ndim - 2))), out, out.new_zeros(()))


@dataclass
class PackedForwards:
    """What :func:`packed_encoder` yields: ``count``, the first module's forwards it packed so far."""

    count: int = 0


@contextmanager
def packed_encoder(model, plan: PackPlan, unpadding: Unpadding):
    """Inside the block, ``model``'s next forward runs its first module on ``plan``'s packed rows.

    The model must be called on the mini-batch ``plan`` was made for: per-token tensors of shape
    ``(plan.rows, plan.width)`` with right padding. The first module gets them packed (with the
    block-diagonal ``attention_mask`` and per-row ``position_ids``); its outputs of shape
    ``(packs, pack_width, ...)`` (``token_embeddings``, ``all_layer_embeddings``) are scattered back to
    ``(rows, width, ...)`` (zeros at padding) into the original features, which the remaining modules
    read. ``model`` may be DDP- or compile-wrapped. Yields a :class:`PackedForwards` counting the packed
    forwards, so a caller can check that the model really ran on the packs.

    Raises:
        RuntimeError: the features the model was called with do not match ``plan``.
    """
    first = _first_module(model)
    dtype = next(first.parameters()).dtype
    original: dict = {}
    ran = PackedForwards()

    def pre(module, args, kwargs):
        features = args[0]
        mask = features["attention_mask"]
        if tuple(mask.shape) != (plan.rows, plan.width):
            raise RuntimeError(f"packed mini-batch: mask {tuple(mask.shape)} but plan ({plan.rows}, {plan.width})")
        original["features"] = features
        packed = {}
        for key, value in features.items():
            if key == "attention_mask":
                packed[key] = _block_mask(plan, unpadding.mask, dtype)
            elif isinstance(value, torch.Tensor) and value.ndim >= 2 and tuple(value.shape[:2]) == tuple(mask.shape):
                packed[key] = _pack_tensor(value, plan)
            else:
                packed[key] = value
        packed["position_ids"] = plan.positions + unpadding.position_offset
        original["packed_keys"] = set(packed)
        ran.count += 1
        return (packed, *args[1:]), kwargs

    def post(module, args, kwargs, output):
        features = original.pop("features")
        keep = features["attention_mask"].bool()
        shape = (plan.packs, plan.pack_width)

        def back(v):
            if isinstance(v, torch.Tensor) and v.ndim >= 2 and tuple(v.shape[:2]) == shape:
                return _unpack_tensor(v, plan, keep)
            if isinstance(v, (list, tuple)):
                return type(v)(back(x) for x in v)
            return v

        for key, value in output.items():
            if key not in original["packed_keys"]:
                features[key] = back(value)
        return features

    handles = [
        first.register_forward_pre_hook(pre, with_kwargs=True),
        first.register_forward_hook(post, with_kwargs=True),
    ]
    try:
        yield ran
    finally:
        for handle in handles:
            handle.remove()


def column_lengths(feature: dict) -> list[int] | None:
    """Each row's token count when ``feature`` can be packed, else None: an ``attention_mask`` of
    shape ``(rows, width)`` with right padding, and besides it only per-token tensors of the same
    shape and sentence-transformers' bookkeeping keys. One host read of the lengths."""
    mask = feature.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.ndim != 2 or mask.shape[0] == 0:
        return None
    for key, value in feature.items():
        if key in _PASSTHROUGH_KEYS or not isinstance(value, torch.Tensor) or key == "attention_mask":
            continue
        if value.ndim < 2 or tuple(value.shape[:2]) != tuple(mask.shape):
            return None
    lengths = mask.sum(dim=1)
    right = torch.arange(mask.shape[1], device=mask.device)[None, :] < lengths[:, None]
    not_right = (mask.bool() != right).any() | (lengths == 0).any()
    host = torch.cat([lengths, not_right.to(lengths.dtype).view(1)]).tolist()
    return None if host[-1] else [int(n) for n in host[:-1]]


@dataclass
class PackRegistry:
    """The plans of the features of the current step, so that the cached loss's second pass
    replays the first pass's packing (a plan is a pure function of the lengths, so a miss, e.g.
    after another forward, recomputes the same plan). It holds the step's features: the loss
    calls :meth:`reset` when the step's backward ends."""

    unpadding: Unpadding
    _plans: dict[int, tuple[dict, dict[tuple[int, int], PackPlan | None]]] = field(default_factory=dict)

    def reset(self) -> None:
        """Forget every plan (and the features they hold)."""
        self._plans = {}

    def planned(self) -> int:
        """Mini-batches of the registered columns that have a plan (are to run packed)."""
        return sum(plan is not None for _, plans in self._plans.values() for plan in plans.values())

    def plan_column(self, feature: dict, ranges: list[tuple[int, int]]) -> list[PackPlan] | None:
        """Plan every mini-batch of one column (one host read of its lengths); None when the column
        cannot be packed."""
        lengths = column_lengths(feature)
        if lengths is None:
            self._plans[id(feature)] = (feature, {r: None for r in ranges})
            return None
        device = feature["attention_mask"].device
        plans = {(b, e): plan_packing(lengths[b:e], self.unpadding.cost_per_width, device) for b, e in ranges if e > b}
        self._plans[id(feature)] = (feature, plans)
        return list(plans.values())

    def plan_for(self, feature: dict, begin: int, end: int) -> PackPlan | None:
        """The plan of ``feature``'s rows ``begin:end`` (from :meth:`plan_column`, else recomputed)."""
        entry = self._plans.get(id(feature))
        if entry is not None and entry[0] is feature and (begin, end) in entry[1]:
            return entry[1][(begin, end)]
        lengths = column_lengths(feature)
        if lengths is None or end <= begin:
            return None
        end = min(end, len(lengths))
        return plan_packing(lengths[begin:end], self.unpadding.cost_per_width, feature["attention_mask"].device)


# The start-up check's rows: 1 to 96 words over the letters and digits every tokenizer has, so the
# longest rows (truncated to max_seq_length) outreach a small attention window and the rows differ in
# content and length; packed at about half their tokens per pack, most packs hold several rows.
_CHECK_WORDS = (96, 61, 40, 27, 18, 12, 8, 5, 3, 2, 1)
_CHECK_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"
# Largest relative difference (L2 per row) between a packed row's embedding and the row embedded alone.
# fp32 (matmuls at full precision during the check): shapes change only the summation order, measured
# <= 1e-6 on the test models, while one leaked key or a binding window moves a row by 1e-4 .. 1e-2;
# 1e-5 catches a 1e-3 difference with a 100x margin. bf16/fp16 weights round each product to 8/11
# bits, so the packed and alone paths differ by up to ~1e-2 without any fault: only gross faults are
# caught there (the config rule of local_attention_reason does not depend on the dtype).
_TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-5}
_HALF_TOLERANCE = 3e-2


def _configs(config):
    """``config`` and the configs nested in it (``text_config``...), each once."""
    seen, stack = [], [config]
    while stack:
        cfg = stack.pop()
        if any(cfg is c for c in seen):
            continue
        seen.append(cfg)
        stack.extend(v for v in vars(cfg).values() if hasattr(v, "to_dict") and hasattr(v, "model_type"))
    return seen


def local_attention_reason(config, max_seq_length: int | None) -> str:
    """Why ``config`` declares attention that is not full attention within a row, else "".

    A packed row gets the block-diagonal mask instead of the model's own masks, so any attention narrower
    than the row (a sliding window, local blocks, chunks) would silently become full attention. A
    sliding window of ``w`` tokens (``sliding_window``, ModernBERT's half ``local_attention``) cannot bind
    rows of at most ``w`` tokens: accepted when ``max_seq_length <= w``.

    Args:
        config: the transformers config of the encoder.
        max_seq_length: the longest row the model is given (tokens), None if unbounded.
    """

    def window_binds(window) -> bool:
        return not (isinstance(window, int) and max_seq_length is not None and max_seq_length <= window)

    for cfg in _configs(config):
        window = getattr(cfg, "sliding_window", None)
        reach = f"{window}-token window" if isinstance(window, int) else "a window"
        reach += f", rows up to {max_seq_length} tokens"
        layer_types = getattr(cfg, "layer_types", None)
        if layer_types:  # authoritative where present (Qwen2/ModernBERT set sliding_window regardless)
            kinds = sorted(set(layer_types) - {"full_attention"})
            if kinds == ["sliding_attention"] and not window_binds(window):
                continue
            if kinds == ["sliding_attention"]:
                count = sum(t == "sliding_attention" for t in layer_types)
                return f"{count} of its {len(layer_types)} layers use sliding-window attention ({reach})"
            if kinds:
                return f"its layers include {', '.join(kinds)} (layer_types), not full attention within a row"
            continue
        if window and getattr(cfg, "use_sliding_window", True) and window_binds(window):
            return f"it uses sliding-window attention (sliding_window: {reach})"
        local = getattr(cfg, "local_attention", None)
        half = local // 2 if isinstance(local, int) else None  # ModernBERT: local_attention is both sides
        if local and getattr(cfg, "global_attn_every_n_layers", 1) != 1 and window_binds(half):
            return f"it uses sliding-window attention (local_attention: {local} tokens)"
        if getattr(cfg, "attention_window", None):
            return f"it uses local attention (attention_window: {cfg.attention_window})"
        if getattr(cfg, "attention_type", None) == "block_sparse":
            return "it uses block-sparse attention (attention_type: block_sparse)"
        if getattr(cfg, "attention_chunk_size", None):
            return f"it uses chunked attention (attention_chunk_size: {cfg.attention_chunk_size})"
    return ""


def _check_texts() -> list[str]:
    n = len(_CHECK_ALPHABET)
    return [" ".join(_CHECK_ALPHABET[(7 * i + 5 * j) % n] for j in range(k)) for i, k in enumerate(_CHECK_WORDS)]


@contextmanager
def _exact_eval(model, device: torch.device):
    """Eval mode, no autograd, fp32 matmuls at full precision (no TF32) and no ambient autocast; every
    module's mode, the float32 matmul precision and the RNG state are given back as they were."""
    modes = [(module, module.training) for module in model.modules()]
    try:  # the legacy API, as cembed.plan.precision.enable_tf32 sets it
        precision, cudnn_tf32 = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    except RuntimeError:  # someone set the per-backend fp32_precision: reading the legacy one raises; leave it
        precision = cudnn_tf32 = None
    model.eval()
    try:
        if precision is not None:
            torch.set_float32_matmul_precision("highest")
            torch.backends.cudnn.allow_tf32 = False
        with torch.no_grad(), torch.random.fork_rng(devices=[]), torch.autocast(device.type, enabled=False):
            yield
    finally:
        if precision is not None:
            torch.set_float32_matmul_precision(precision)
            torch.backends.cudnn.allow_tf32 = cudnn_tf32
        for module, training in modes:  # each module's own flag: model.train(x) would set them all alike
            module.training = training


def _agrees(model, first, unpadding: Unpadding) -> tuple[bool, str]:
    """Embed the check rows packed (several rows per pack) and each row alone, and compare per row.

    Returns:
        (True, "") when every packed row's sentence embedding is within the dtype's tolerance of the
        row embedded alone (relative L2), else (False, why).
    """
    parameter = next(first.parameters())
    device = parameter.device
    try:
        with _exact_eval(model, device):
            features = model.preprocess(_check_texts())
            features = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in features.items()}
            lengths = column_lengths(features)
            if lengths is None:
                return False, "its tokenizer pads on the left or adds features other than token ids"
            alone = torch.cat(
                [
                    model(
                        {
                            k: v[i : i + 1, : lengths[i]] if isinstance(v, torch.Tensor) else v
                            for k, v in features.items()
                        }
                    )["sentence_embedding"].float()
                    for i in range(len(lengths))
                ]
            )
            capacity = max(max(lengths), -(-sum(lengths) // 2))
            plan = plan_packing(lengths, 0.0, device, capacity=capacity)
            with packed_encoder(model, plan, unpadding):
                packed = model(dict(features))["sentence_embedding"].float()
    except Exception as err:  # noqa: BLE001 - any failure means: not supported, fall back
        return False, f"the packed forward fails ({type(err).__name__}: {first_line(err, 120)})"
    rel = (packed - alone).norm(dim=1) / alone.norm(dim=1).clamp_min(1e-12)
    worst = int(rel.argmax())
    tolerance = _TOLERANCE.get(parameter.dtype, _HALF_TOLERANCE)
    if not float(rel[worst]) <= tolerance:
        return False, (
            f"a packed row ({lengths[worst]} tokens) differs from the row embedded alone by "
            f"{float(rel[worst]):.1e} relative (tolerance {tolerance:.0e})"
        )
    return True, ""


def resolve_unpad(model, setting: UnpadSetting = "auto") -> Unpadding:
    """Decide whether ``model``'s cached-loss mini-batches are packed (``batch.unpad``).

    Args:
        model: a SentenceTransformer (unwrapped).
        setting: ``auto`` (pack where supported), True (pack, else refuse), False (never pack).

    Returns:
        An :class:`Unpadding`; its description says which path runs and, when padding, why.

    Raises:
        ModelRefused: ``setting`` is True and the model does not support packed rows.
    """
    if setting is False:
        return Unpadding(False, "padded mini-batches (batch.unpad: false, or train.torch_compile: true)")
    from sentence_transformers.base.modules.transformer import Transformer

    first = _first_module(model)
    reason = ""
    impl = None
    if not isinstance(first, Transformer):
        reason = f"its first module is {type(first).__name__}, not a transformers encoder"
    else:
        impl = getattr(first.auto_model.config, "_attn_implementation", None)
        if impl not in ("sdpa", "eager"):
            reason = f"its attention ({impl}) does not take a block-diagonal mask (only sdpa and eager do)"
        elif "position_ids" not in inspect.signature(first.auto_model.forward).parameters:
            reason = f"{type(first.auto_model).__name__} takes no position_ids"
        else:
            reason = local_attention_reason(first.auto_model.config, getattr(first, "max_seq_length", None))
    if not reason:
        offset = getattr(first, "_infer_flatten_position_offset", lambda: 0)()
        unpadding = Unpadding(
            True,
            f"packed rows, no padding ({impl} attention, block-diagonal mask, position_ids per row)",
            "bool" if impl == "sdpa" else "additive",
            int(offset),
            attention_cost(first.auto_model.config),
        )
        ok, reason = _agrees(model, first, unpadding)
        if ok:
            return unpadding
    if setting is True:
        raise ModelRefused(
            f"batch.unpad: true, but this model cannot run packed rows: {reason}; "
            "set batch.unpad: auto (pads where packing is unsupported) or false"
        )
    return Unpadding(False, f"padded mini-batches, sorted by length (packing unsupported: {reason})")
