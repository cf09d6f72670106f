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
``transformers.masking_utils``), confirmed by embedding a few rows both ways. Flash attention
ignores a 4D mask; relative-position models may differ: those fall back to sorted padding.

Packing plans (which rows share a pack, the index tensors): :mod:`cembed.model.packing`.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import torch

from cembed.errors import ModelRefused
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


def _agrees(model, first, unpadding: Unpadding) -> tuple[bool, str]:
    """Embed a few rows of different lengths padded and packed (two rows sharing a pack) and compare."""
    texts = ["a b c d e f g h i j", "a b", "a b c d e", "a"]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            features = model.tokenize(texts)
            device = next(first.parameters()).device
            features = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in features.items()}
            lengths = column_lengths(features)
            if lengths is None:
                return False, "its tokenizer pads on the left or adds features other than token ids"
            padded = model(dict(features))["sentence_embedding"].float()
            plan = plan_packing(lengths, 0.0, device, capacity=max(lengths))
            with packed_encoder(model, plan, unpadding):
                packed = model(dict(features))["sentence_embedding"].float()
    except Exception as err:  # noqa: BLE001 - any failure means: not supported, fall back
        return False, f"the packed forward fails ({type(err).__name__}: {str(err).strip().splitlines()[0][:120]})"
    finally:
        model.train(was_training)
    rel = float((packed - padded).norm() / padded.norm().clamp_min(1e-12))
    tolerance = 1e-4 if next(first.parameters()).dtype == torch.float32 else 3e-2
    if not rel <= tolerance:
        return False, f"its packed output differs from the padded one ({rel:.1e} relative)"
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
