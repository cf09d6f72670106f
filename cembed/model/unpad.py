"""Unpadded attention: a cached-loss mini-batch's rows packed into sequences without padding.

Padded, a mini-batch runs the encoder on ``rows x longest`` positions. Packed, the rows lie end to
end in a few sequences ("packs"), each token keeps its position within its row (``position_ids``)
and the attention masks keep each row attending to itself only, so every token's output equals the
padded path's (to float rounding) and no position is padding.

By composition with sentence-transformers (no copy of its modules' code): during one mini-batch's
forward (:func:`packed_encoder`) a forward pre-hook on the model's first module, the
``Transformer``, hands it the packed inputs; it runs its transformers model (``auto_model``) on
them; a forward hook scatters the token embeddings back to the padded ``(rows, width, dim)``
layout, and the model's own remaining modules (``Pooling``, ``Normalize``...) run on that (so
last-token pooling reads each row's last real token, its EOS, from the padded layout as before). The
hooks live inside the model's forward, so a DDP-wrapped model is called as before.

How a pack's rows are kept apart (:class:`PackMode`, decided in one place, :func:`resolve_unpad`):

* ``position_ids`` (preferred): transformers (>= 5) builds the packed masks itself when a model
  passes ``position_ids`` to its mask functions and gets no ``attention_mask``: ``masking_utils``
  (``find_packed_sequence_indices``, ``packed_sequence_mask_function``) starts a new sequence wherever
  the positions do not go up by one, and builds the causal, bidirectional and sliding-window masks of
  sdpa, eager and flex attention per row (BERT, XLM-R, Qwen2/Qwen3, Llama, Mistral). The packed
  positions restart at 0 (plus the RoBERTa offset) for each row, so causal decoders and windows work.
* ``layer_masks``: a model that takes a mapping of per-layer-type masks but does not pass
  ``position_ids`` to its mask functions (ModernBERT) gets the mapping, each mask built by the same
  library functions from the packed ``position_ids`` (block-diagonal for ``full_attention``,
  block-diagonal and window for ``sliding_attention``).
* ``block``: a hand-built block-diagonal 4D mask (sdpa and eager only; bidirectional full attention
  within a row, so only for models that declare nothing narrower, :func:`local_attention_reason`).

A PEFT-wrapped model (LoRA) is looked through to its base model (:func:`backbone`). Each mode is
confirmed at start-up by embedding rows longer than any local window, several per pack, packed and
each alone (:func:`_agrees`); the first mode that agrees is used, and a model for which none does
pads, the reason naming the measured difference. Flash attention needs the packs as one flattened
sequence (not done here); relative-position models without ``position_ids`` (T5) pad, saying why.

Packing plans (which rows share a pack, the index tensors): :mod:`cembed.model.packing`.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import torch

from cembed.errors import ModelRefused, first_line
from cembed.model.kinds.lookup import kind_of
from cembed.model.packing import PackPlan, attention_cost, plan_packing

# Keys a packed column may carry besides its per-token tensors: sentence-transformers' bookkeeping.
_PASSTHROUGH_KEYS = frozenset({"modality", "prompt_length", "task"})

UnpadSetting = Literal["auto", True, False]
# How a pack's rows are kept apart, in order of preference (see the module docstring).
PackMode = Literal["position_ids", "layer_masks", "block"]
PACK_MODES: tuple[PackMode, ...] = ("position_ids", "layer_masks", "block")
# The per-layer-type masks of ``layer_masks`` mode: the transformers mask function of each layer type.
_LAYER_MASK_FUNCTIONS = {
    "full_attention": "create_bidirectional_mask",
    "sliding_attention": "create_bidirectional_sliding_window_mask",
}


@dataclass(frozen=True)
class Unpadding:
    """Whether a loss packs its mini-batches, and how (:func:`resolve_unpad`'s answer).

    Attributes:
        enabled: mini-batches are packed.
        description: one line for ``validate``, the run header and ``run_summary.json``.
        mode: how a pack's rows are kept apart (:data:`PackMode`).
        mask: ``block`` mode's mask: ``bool`` (sdpa: True = attend) or ``additive`` (eager: 0 / dtype minimum).
        position_offset: added to each row's positions (RoBERTa-style tables start after padding_idx).
        cost_per_width: :func:`attention_cost` of the model.
    """

    enabled: bool
    description: str
    mode: PackMode = "position_ids"
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


def backbone(auto_model):
    """The transformers model under ``auto_model``: a PEFT wrapper's base model (LoRA), else itself.

    ``PeftModel.forward`` takes ``*args, **kwargs`` and hands them on to the base model, so what the
    packed forward may pass (``position_ids``, a mask mapping) is what the base model's forward takes.
    """
    get_base = getattr(auto_model, "get_base_model", None)
    return get_base() if callable(get_base) else auto_model


def packed_positions(plan: PackPlan, offset: int) -> torch.Tensor:
    """``(packs, pack_width)`` long: each token's position within its own row plus ``offset`` (the
    RoBERTa-style start of the position table; 0 after a pack's last row). Restarting at each row is
    what tells transformers where a pack's rows begin (a step other than +1 starts a new row)."""
    return plan.positions + offset


def _layer_masks(config, plan: PackPlan, positions: torch.Tensor, dtype: torch.dtype) -> dict:
    """``layer_masks`` mode: ``{layer type: mask}`` for each of ``config.layer_types``, each built by
    transformers' own mask function from the packed ``positions`` (no ``attention_mask``: the library
    then starts a new row wherever the positions do not go up by one, and applies a sliding window
    to the positions within a row)."""
    from transformers import masking_utils

    # The mask functions read only the batch size, length, dtype and device of their inputs_embeds.
    shape_only = torch.empty(plan.packs, plan.pack_width, 0, dtype=dtype, device=positions.device)
    return {
        kind: getattr(masking_utils, _LAYER_MASK_FUNCTIONS[kind])(
            config=config, inputs_embeds=shape_only, attention_mask=None, position_ids=positions
        )
        for kind in dict.fromkeys(config.layer_types)
    }


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
    ``(plan.rows, plan.width)`` with right padding. The first module gets them packed, with per-row
    ``position_ids`` and, by ``unpadding.mode``, no ``attention_mask`` (transformers builds the packed
    masks), the per-layer-type mask mapping, or the block-diagonal 4D mask; its outputs of shape
    ``(packs, pack_width, ...)`` (``token_embeddings``, ``all_layer_embeddings``) are scattered back to
    ``(rows, width, ...)`` (zeros at padding) into the original features, which the remaining modules
    read. ``model`` may be DDP- or compile-wrapped. Yields a :class:`PackedForwards` counting the packed
    forwards, so a caller can check that the model really ran on the packs.

    Raises:
        RuntimeError: the features the model was called with do not match ``plan``.
    """
    first = _first_module(model)
    dtype = next(first.parameters()).dtype
    base = backbone(first.auto_model)
    positions = packed_positions(plan, unpadding.position_offset)
    # A decoder's forward would start a KV cache (use_cache defaults to the config's True), and with a
    # cache transformers does not look for packed rows in the positions.
    no_cache = {"use_cache": False} if "use_cache" in inspect.signature(base.forward).parameters else {}
    original: dict = {}
    ran = PackedForwards()

    def packed_mask():
        if unpadding.mode == "block":
            return _block_mask(plan, unpadding.mask, dtype)
        if unpadding.mode == "layer_masks":
            return _layer_masks(base.config, plan, positions, dtype)
        return None

    def pre(module, args, kwargs):
        features = args[0]
        mask = features["attention_mask"]
        if tuple(mask.shape) != (plan.rows, plan.width):
            raise RuntimeError(f"packed mini-batch: mask {tuple(mask.shape)} but plan ({plan.rows}, {plan.width})")
        original["features"] = features
        packed = {}
        for key, value in features.items():
            if key == "attention_mask":
                packed[key] = packed_mask()
            elif isinstance(value, torch.Tensor) and value.ndim >= 2 and tuple(value.shape[:2]) == tuple(mask.shape):
                packed[key] = _pack_tensor(value, plan)
            else:
                packed[key] = value
        packed["position_ids"] = positions
        packed.update(no_cache)
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
    shape and sentence-transformers' bookkeeping keys; no position outside the attention mask that is
    embedded all the same (a multi-vector query's expansion tokens, ``query_expansion_positions``, when
    they are not attended to: a pack would drop them). One host read of the lengths."""
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
    expansion = feature.get("query_expansion_positions")
    if isinstance(expansion, torch.Tensor):  # ColBERT query expansion: positions embedded but not attended to
        not_right = not_right | (expansion.bool() & ~mask.bool()).any()
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


# The start-up check's rows: 1 to 96 words over the letters and digits every tokenizer has (about a
# token a word), so the rows differ in content and length; packed at about half their tokens per
# pack, most packs hold several rows. A model with a local window also gets two rows of
# window + _BEYOND_WINDOW words (:func:`_check_texts`), so a window binds in several rows of a pack.
_CHECK_WORDS = (96, 61, 40, 27, 18, 12, 8, 5, 3, 2, 1)
_BEYOND_WINDOW = 32
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


def widest_window(config) -> int:
    """The widest local attention span ``config`` (or a config nested in it) declares, in tokens to one
    side (``sliding_window``, half of ModernBERT's ``local_attention``, ``attention_window``,
    ``attention_chunk_size``); 0 when it declares none."""
    spans = [0]
    for cfg in _configs(config):
        for name in ("sliding_window", "attention_window", "attention_chunk_size"):
            value = getattr(cfg, name, None)
            spans += value if isinstance(value, list) else [value]
        local = getattr(cfg, "local_attention", None)
        spans.append(local // 2 if isinstance(local, int) else None)
    return max(int(v) for v in spans if isinstance(v, int))


def _check_texts(window: int = 0) -> list[str]:
    """The start-up check's texts: ``_CHECK_WORDS`` words each, after two of ``window +
    _BEYOND_WINDOW`` words when the model has a local ``window`` (tokens to one side)."""
    n = len(_CHECK_ALPHABET)
    words = ((window + _BEYOND_WINDOW,) * 2 if window else ()) + _CHECK_WORDS
    return [" ".join(_CHECK_ALPHABET[(7 * i + 5 * j) % n] for j in range(k)) for i, k in enumerate(words)]


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
    """Embed the check rows packed (several rows per pack) and each row alone, and compare per row;
    the rows outreach the model's widest local window (:func:`widest_window`) where it has one.

    Returns:
        (True, "") when what every packed row became (its kind's ``text_outputs``: a sentence
        embedding, a row's token vectors) is within the dtype's tolerance of the row embedded alone
        (relative L2), else (False, why).
    """
    parameter = next(first.parameters())
    device = parameter.device
    try:
        with _exact_eval(model, device):
            features = model.preprocess(_check_texts(widest_window(first.auto_model.config)))
            features = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in features.items()}
            lengths = column_lengths(features)
            if lengths is None:
                return False, "its tokenizer pads on the left or adds features other than token ids"
            rows = kind_of(model, default="dense").text_outputs
            alone = [
                rows(
                    model(
                        {
                            k: v[i : i + 1, : lengths[i]] if isinstance(v, torch.Tensor) else v
                            for k, v in features.items()
                        }
                    )
                )[0]
                for i in range(len(lengths))
            ]
            capacity = max(max(lengths), -(-sum(lengths) // 2))
            plan = plan_packing(lengths, 0.0, device, capacity=capacity)
            with packed_encoder(model, plan, unpadding):
                packed = rows(model(dict(features)))
    except Exception as err:  # noqa: BLE001 - any failure means: not supported, fall back
        return False, f"the packed forward fails ({type(err).__name__}: {first_line(err, 120)})"
    if [p.shape for p in packed] != [a.shape for a in alone]:  # e.g. a token vector more or less in a row
        return False, "a packed row's output has another shape than the row's alone"
    rel = torch.stack(
        [(p.float() - a.float()).norm() / a.float().norm().clamp_min(1e-12) for p, a in zip(packed, alone)]
    )
    worst = int(rel.argmax())
    tolerance = _TOLERANCE.get(parameter.dtype, _HALF_TOLERANCE)
    if not float(rel[worst]) <= tolerance:
        return False, (
            f"a packed row ({lengths[worst]} tokens) differs from the row embedded alone by "
            f"{float(rel[worst]):.1e} relative (tolerance {tolerance:.0e})"
        )
    return True, ""


# Attention implementations that build their masks through transformers.masking_utils (the packed
# modes); flash attention takes no mask and reads row boundaries from position_ids only in a batch of one.
_LIBRARY_MASKS = ("sdpa", "eager", "flex_attention")
_BLOCK_MASKS = ("sdpa", "eager")  # take a prepared 4D tensor mask as is


def mode_obstacle(mode: PackMode, config, impl: str | None, max_seq_length: int | None) -> str | None:
    """Why ``mode`` cannot run a model of ``config`` and attention ``impl`` at all, before any
    measurement: "" when it may (the start-up check decides), None when the mode does not concern the
    model (``layer_masks`` without ``layer_types``), else the reason.

    Args:
        mode: a :data:`PackMode`.
        config: the transformers config of the (base) model.
        impl: its ``_attn_implementation``.
        max_seq_length: the longest row the model is given (tokens), None if unbounded.
    """
    if mode == "block":
        if impl not in _BLOCK_MASKS:
            return f"{impl} attention takes no hand-built 4D mask"
        return local_attention_reason(config, max_seq_length)
    if impl not in _LIBRARY_MASKS:
        if str(impl).startswith("flash"):
            return f"{impl} reads packed rows from position_ids only as one flattened sequence (not done here)"
        return f"its attention ({impl}) builds no packed masks (only {', '.join(_LIBRARY_MASKS)} do)"
    if mode == "layer_masks":
        types = getattr(config, "layer_types", None)
        if not types:
            return None
        unknown = sorted(set(types) - set(_LAYER_MASK_FUNCTIONS))
        return f"no packed mask for its layer types {', '.join(unknown)}" if unknown else ""
    return ""


def _description(mode: PackMode, impl: str, auto_model, base) -> str:
    through = f", through {type(auto_model).__name__} to {type(base).__name__}" if base is not auto_model else ""
    if mode == "position_ids":
        how = "transformers' packed-sequence masks from position_ids restarting per row"
    elif mode == "layer_masks":
        how = f"per-layer-type masks ({', '.join(dict.fromkeys(base.config.layer_types))}) from position_ids per row"
    else:
        how = "block-diagonal mask, position_ids per row"
    return f"packed rows, no padding ({impl} attention, {how}{through})"


_MODE_NAMES = {"position_ids": "position_ids", "layer_masks": "layer masks", "block": "block mask"}


def resolve_unpad(model, setting: UnpadSetting = "auto") -> Unpadding:
    """Decide whether ``model``'s cached-loss mini-batches are packed (``batch.unpad``), and how.

    The packing modes (:data:`PACK_MODES`, the module docstring) are tried in order of preference:
    each that may apply (:func:`mode_obstacle`) is checked at start-up against the rows embedded alone
    (:func:`_agrees`), and the first that agrees is used. A PEFT-wrapped model (LoRA) is judged by its
    base model (:func:`backbone`).

    Args:
        model: a SentenceTransformer (unwrapped).
        setting: ``auto`` (pack where supported), True (pack, else refuse), False (never pack).

    Returns:
        An :class:`Unpadding`; its description says which path runs and, when padding, why (each
        mode's obstacle or measured difference).

    Raises:
        ModelRefused: ``setting`` is True and the model does not support packed rows.
    """
    if setting is False:
        return Unpadding(False, "padded mini-batches (batch.unpad: false, or train.torch_compile: true)")
    from sentence_transformers.base.modules.transformer import Transformer

    first = _first_module(model)
    reasons: list[str] = []
    if not isinstance(first, Transformer):
        reasons.append(f"its first module is {type(first).__name__}, not a transformers encoder")
    elif "position_ids" not in inspect.signature(backbone(first.auto_model).forward).parameters:
        reasons.append(f"{type(backbone(first.auto_model)).__name__} takes no position_ids")
    else:
        base = backbone(first.auto_model)
        impl = getattr(base.config, "_attn_implementation", None)
        max_seq_length = getattr(first, "max_seq_length", None)
        offset = int(getattr(first, "_infer_flatten_position_offset", lambda: 0)())
        for mode in PACK_MODES:
            obstacle = mode_obstacle(mode, base.config, impl, max_seq_length)
            if obstacle is None:
                continue
            if not obstacle:
                unpadding = Unpadding(
                    True,
                    _description(mode, impl, first.auto_model, base),
                    mode,
                    "bool" if impl == "sdpa" else "additive",
                    offset,
                    attention_cost(base.config),
                )
                ok, obstacle = _agrees(model, first, unpadding)
                if ok:
                    return unpadding
            reasons.append(f"{_MODE_NAMES[mode]}: {obstacle}")
    reason = "; ".join(dict.fromkeys(reasons))
    if setting is True:
        raise ModelRefused(
            f"batch.unpad: true, but this model cannot run packed rows: {reason}; "
            "set batch.unpad: auto (pads where packing is unsupported) or false"
        )
    return Unpadding(False, f"padded mini-batches, sorted by length (packing unsupported: {reason})")
