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

Packing (:func:`plan_packing`): best-fit decreasing bin packing (Johnson 1974) into packs of a
capacity chosen per mini-batch among multiples of its longest row, minimising the estimated cost
``packs x width x (1 + width / (2 hidden + intermediate))``: linear layers cost the same per
position, attention grows with the mask's width; ``width / (2 d_model + d_ff)`` is attention's
share of a layer's FLOPs per token in the ``6N + 12 L H Q T`` count of PaLM (Chowdhery et al. 2022,
arXiv:2204.02311, App. B). Capacity 1x the longest row never costs more than padding.
"""

from __future__ import annotations

import inspect
import math
from bisect import bisect_left, insort
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal, Sequence

import numpy as np
import torch

from cembed.errors import ModelRefused

# Multiples of the longest row tried as pack capacity (stopping once one pack holds every row).
CAPACITY_FACTORS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0)
# Headroom over an even split of the tokens, so best-fit can place rows that do not divide evenly.
BALANCE_SLACK = (0.0, 0.01, 0.02, 0.04, 0.08)
# Keys a packed column may carry besides its per-token tensors: sentence-transformers' bookkeeping.
_PASSTHROUGH_KEYS = frozenset({"modality", "prompt_length", "task"})

UnpadSetting = Literal["auto", True, False]


@dataclass(frozen=True)
class PackPlan:
    """How one mini-batch's rows are packed; index tensors live on the features' device.

    Attributes:
        rows: rows in the mini-batch.
        width: its padded width (its longest row), the layout the token embeddings go back to.
        packs: packed sequences.
        pack_width: their width (the fullest pack's fill).
        real: non-padding tokens (sum of the row lengths).
        gather: ``(packs * pack_width,)`` long: for each packed position, the padded flat index
            ``row * width + position`` it reads (0 after a pack's last row; those positions attend
            only to each other and are dropped).
        scatter: ``(rows * width,)`` long: for each padded position, the packed flat index holding it
            (0 for padding, which is zeroed).
        segments: ``(packs, pack_width)`` long: the row of each packed position, -1 after the last row.
        positions: ``(packs, pack_width)`` long: each token's position within its own row.
    """

    rows: int
    width: int
    packs: int
    pack_width: int
    real: int
    gather: torch.Tensor
    scatter: torch.Tensor
    segments: torch.Tensor
    positions: torch.Tensor

    @property
    def processed(self) -> int:
        """Positions the encoder runs on: ``packs x pack_width``."""
        return self.packs * self.pack_width


def pack_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: each row, longest first, goes to the pack with the least room that still
    fits it, else opens a new pack.

    Args:
        lengths: each row's token count (all >= 1 and <= ``capacity``).
        capacity: the most tokens a pack holds.

    Returns:
        The packs, each a list of row indices in placement order (deterministic: ties go to the
        earlier row and the earlier pack).

    Raises:
        ValueError: a row is longer than ``capacity``.
    """
    if lengths and max(lengths) > capacity:
        raise ValueError(f"a row of {max(lengths)} tokens does not fit a pack of {capacity}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    packs: list[list[int]] = []
    rooms: list[tuple[int, int]] = []  # (room left, pack index), sorted
    for i in order:
        k = bisect_left(rooms, (lengths[i], -1))
        if k == len(rooms):
            packs.append([i])
            insort(rooms, (capacity - lengths[i], len(packs) - 1))
        else:
            room, p = rooms.pop(k)
            packs[p].append(i)
            insort(rooms, (room - lengths[i], p))
    return packs


def attention_cost(config) -> float:
    """Attention's encoder cost per position of mask width, relative to the linear layers' per
    token: ``1 / (2 hidden_size + intermediate_size)`` (see the module docstring), from a
    transformers config (``intermediate_size`` defaults to 4 x hidden)."""
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    if hidden <= 0:
        return 0.0
    inter = int(getattr(config, "intermediate_size", 0) or 4 * hidden)
    return 1.0 / (2 * hidden + inter)


def _choose_packs(lengths: Sequence[int], cost_per_width: float) -> tuple[list[list[int]], int]:
    """The packs (and their width) of least estimated cost over the capacities tried: multiples of
    the longest row (``CAPACITY_FACTORS``) and, for each, the balanced capacity that splits the
    tokens evenly over the same number of packs (plus ``BALANCE_SLACK``), since every pack is padded
    to the fullest one's width."""
    longest, total = max(lengths), sum(lengths)
    capacities: set[int] = set()
    for factor in CAPACITY_FACTORS:
        capacity = min(max(longest, int(longest * factor)), total)
        capacities.add(capacity)
        balanced = max(longest, math.ceil(total / math.ceil(total / capacity)))
        capacities.update(min(total, int(balanced * (1 + slack))) for slack in BALANCE_SLACK)
    best: tuple[float, list[list[int]], int] | None = None
    for capacity in sorted(capacities):
        packs = pack_rows(lengths, capacity)
        width = max(sum(lengths[i] for i in p) for p in packs)
        cost = len(packs) * width * (1.0 + cost_per_width * width)
        if best is None or cost < best[0]:
            best = (cost, packs, width)
    assert best is not None
    return best[1], best[2]


def plan_packing(
    lengths: Sequence[int], cost_per_width: float, device: torch.device | str = "cpu", capacity: int | None = None
) -> PackPlan:
    """Pack rows of ``lengths`` tokens (right-padded in their mini-batch) and build the index tensors.

    Args:
        lengths: each row's token count (>= 1).
        cost_per_width: :func:`attention_cost` of the model (0: width is free, pack as full as possible).
        device: where the index tensors go (the features' device).
        capacity: a fixed pack capacity instead of the cost-based choice (tests).

    Returns:
        A :class:`PackPlan`.
    """
    lengths = [int(n) for n in lengths]
    if capacity is None:
        packs, pack_width = _choose_packs(lengths, cost_per_width)
    else:
        packs = pack_rows(lengths, capacity)
        pack_width = max(sum(lengths[i] for i in p) for p in packs)
    rows, width = len(lengths), max(lengths)
    lens = np.asarray(lengths, dtype=np.int64)
    row_pack = np.empty(rows, dtype=np.int64)
    row_offset = np.empty(rows, dtype=np.int64)
    for p, members in enumerate(packs):
        fill = 0
        for r in members:
            row_pack[r], row_offset[r] = p, fill
            fill += lengths[r]
    total = int(lens.sum())
    row_of_token = np.repeat(np.arange(rows, dtype=np.int64), lens)
    starts = np.repeat(np.cumsum(lens) - lens, lens)
    pos = np.arange(total, dtype=np.int64) - starts  # each token's position in its row
    src = row_of_token * width + pos
    dst = row_pack[row_of_token] * pack_width + row_offset[row_of_token] + pos
    n_packed = len(packs) * pack_width
    gather = np.zeros(n_packed, dtype=np.int64)
    gather[dst] = src
    scatter = np.zeros(rows * width, dtype=np.int64)
    scatter[src] = dst
    segments = np.full(n_packed, -1, dtype=np.int64)
    segments[dst] = row_of_token
    positions = np.zeros(n_packed, dtype=np.int64)
    positions[dst] = pos

    shape2d = (len(packs), pack_width)
    arrays = (gather, scatter, segments.reshape(shape2d), positions.reshape(shape2d))
    tensors = [torch.from_numpy(a).to(device, non_blocking=True) for a in arrays]
    return PackPlan(rows, width, len(packs), pack_width, total, *tensors)


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


@contextmanager
def packed_encoder(model, plan: PackPlan, unpadding: Unpadding):
    """Inside the block, ``model``'s next forward runs its first module on ``plan``'s packed rows.

    The model must be called on the mini-batch ``plan`` was made for: per-token tensors of shape
    ``(plan.rows, plan.width)`` with right padding. The first module gets them packed (with the
    block-diagonal ``attention_mask`` and per-row ``position_ids``); its outputs of shape
    ``(packs, pack_width, ...)`` (``token_embeddings``, ``all_layer_embeddings``) are scattered back to
    ``(rows, width, ...)`` (zeros at padding) into the original features, which the remaining modules
    read. ``model`` may be DDP- or compile-wrapped.

    Raises:
        RuntimeError: the features the model was called with do not match ``plan``.
    """
    first = _first_module(model)
    dtype = next(first.parameters()).dtype
    original: dict = {}

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
        yield
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
    """The plans of the features of the current forward, so that the cached loss's second pass
    replays the first pass's packing (a plan is a pure function of the lengths, so a miss, e.g.
    after another forward, recomputes the same plan)."""

    unpadding: Unpadding
    _plans: dict[int, tuple[dict, dict[tuple[int, int], PackPlan | None]]] = field(default_factory=dict)

    def reset(self) -> None:
        self._plans = {}

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
        return Unpadding(False, "padded mini-batches (batch.unpad: false)")
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
