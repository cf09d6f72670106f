"""What a cached loss reports about packing is what its encoder ran, for every cached loss (plain
``cached_mnrl``, self-guided ``false_negative_filter``, ``cached_gist``, Matryoshka-wrapped); the packed
path equals the padded one through a real model at more than ``BEST_FIT_MAX_ROWS`` rows per mini-batch
(the dealt plans huge batches take); the step's packing state is released at the end of backward; and
``calculate_loss`` never reuses an earlier forward's row order."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
from conftest import WORDS, make_tiny_model, rel_diff
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.losses.gradcache import CachedLossMixin

import cembed.model.unpad as unpad_module
from cembed.config.loss import CachedGISTLossConfig, CachedMNRLLossConfig
from cembed.losses.length_sorted import LengthSortedMixin
from cembed.losses.mnrl import LengthSortedCachedMNRL
from cembed.losses.registry import build_loss
from cembed.model.packing import BEST_FIT_MAX_ROWS


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """2 layers, hidden 32: small enough for 1,024-row mini-batches on a CPU, deep enough that a
    token seeing another row's tokens in layer 1 changes layer 2's output."""
    return make_tiny_model(tmp_path_factory.mktemp("packed_paths"), layers=2)


@pytest.fixture(scope="module")
def guide_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("packed_paths_guide"), seed=5, hidden=16)


def _loss_cfg(kind: str, guide: str):
    if kind == "cached_mnrl":
        return CachedMNRLLossConfig()
    if kind == "self_guided":
        return CachedMNRLLossConfig(false_negative_filter={"margin": 0.05})
    if kind == "cached_gist":
        return CachedGISTLossConfig(name="cached_gist", guide=guide)
    if kind == "matryoshka":
        return CachedMNRLLossConfig(matryoshka={"dims": [8, 32]})
    if kind == "matryoshka_self_guided":
        return CachedMNRLLossConfig(false_negative_filter={"margin": 0.05}, matryoshka={"dims": [8, 32]})
    raise ValueError(kind)


KINDS = ["cached_mnrl", "self_guided", "cached_gist", "matryoshka", "matryoshka_self_guided"]


def _skewed_texts(n: int, seed: int) -> list[str]:
    """``n`` texts of skewed lengths (lognormal word counts: most short, a long tail up to the
    model's 64 tokens), in a seeded random order, each ending in its own number."""
    rng = np.random.default_rng(seed)
    counts = np.clip(rng.lognormal(np.log(6), 0.8, n).astype(int), 1, 70)
    return [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(k)) + f" {i}" for i, k in enumerate(counts)]


def _features(model, n: int, columns: int = 2) -> list[dict]:
    return [model.tokenize(_skewed_texts(n, seed)) for seed in range(columns)]


class EncoderSpy:
    """Counts the encoder's forwards (the model's first module, the ``Transformer``): packed (it ran on
    per-row ``position_ids``, which the padded path never passes, and no 2D padding mask) or padded,
    and the token positions each ran on. A forward hook registered before any packing hook sees the
    inputs the module really ran on."""

    def __init__(self, model):
        self.calls: list[tuple[bool, int]] = []
        self._handle = model[0].register_forward_hook(self._seen, with_kwargs=True)

    def _seen(self, module, args, kwargs, output):
        features = args[0]
        mask = features["attention_mask"]
        packed = features.get("position_ids") is not None and (mask is None or mask.ndim == 4)
        self.calls.append((packed, int(features["input_ids"].numel())))

    def remove(self):
        self._handle.remove()

    @property
    def packed(self) -> int:
        return sum(p for p, _ in self.calls)

    @property
    def padded(self) -> int:
        return sum(not p for p, _ in self.calls)


def _step(module, features):
    """One training step's loss and the model's flattened gradients."""
    model = module.model
    model.zero_grad()
    value = module([dict(f) for f in features], None)
    value.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return value.detach(), grads


@pytest.mark.slow
@pytest.mark.parametrize("unpad", ["auto", False])
@pytest.mark.parametrize("kind", KINDS)
def test_reported_packed_iff_the_encoder_ran_packs(model_dir, guide_dir, kind, unpad):
    """``BuiltLoss.unpadding.enabled`` and the token counts say what the encoder ran: with packing on,
    every forward of both GradCache passes is packed and the counted processed positions are the
    positions the encoder ran on in the first pass; off, every forward is padded and counted as such.

    Catches: a loss whose ``embed_minibatch`` skips the packing (the self-guided filter ran 0 of its
    forwards packed while reporting packed rows)."""
    model = SentenceTransformer(str(model_dir), device="cpu")
    model.train()
    built = build_loss(model, _loss_cfg(kind, str(guide_dir)), 6, unpad=unpad)
    assert built.unpadding.enabled is (unpad == "auto")
    features = _features(model, 20)  # 4 mini-batches per column
    spy = EncoderSpy(model)
    try:
        with torch.no_grad():
            built.module([dict(f) for f in features], None)
        first_pass = list(spy.calls)
        spy.calls.clear()
        built.module([dict(f) for f in features], None).backward()
    finally:
        spy.remove()
    minibatches = 2 * 4
    assert len(first_pass) == minibatches and len(spy.calls) == 2 * minibatches  # no-grad + replay
    packed = sum(p for p, _ in first_pass) + spy.packed
    if built.unpadding.enabled:
        assert packed == 3 * minibatches, f"{packed} of {3 * minibatches} forwards packed"
    else:
        assert packed == 0
    # what the meter counted is what the encoder ran on (twice: the no-grad forward and the step)
    assert built.token_counts.processed == 2 * sum(n for _, n in first_pass)
    real = sum(int(f["attention_mask"].sum()) for f in features)
    assert built.token_counts.real == 2 * real


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,rows,mbs",
    [
        ("cached_mnrl", 65, 65),
        ("cached_mnrl", 300, 300),
        ("cached_mnrl", 1024, 1024),
        ("self_guided", 300, 300),
        ("self_guided", 1024, 512),
        ("cached_gist", 300, 300),
        ("matryoshka", 300, 150),
    ],
)
def test_packed_equals_padded_at_dealt_sizes(model_dir, guide_dir, kind, rows, mbs):
    """More than ``BEST_FIT_MAX_ROWS`` rows per mini-batch take the dealt plans (``deal_rows``):
    packed == padded for the loss, the gradients and every row's embedding, through a real 2-layer model.

    What the tolerances catch (checked on broken copies; the honest path: loss within ~1e-7, gradients
    ~1e-6, embeddings ~5e-8): every token's position shifted by one in the dealt plans fails every case
    (loss off by 1.7e-3 .. 4e-2); a one-position leak in the dealt plans (a row's first token also
    attending to the previous row's last token, which ``resolve_unpad``'s few-row start-up check
    cannot see) fails every case too (loss 8.6e-6 .. 3e-4, gradients ~7e-4, embeddings ~1e-3)."""
    assert mbs > BEST_FIT_MAX_ROWS
    model = SentenceTransformer(str(model_dir), device="cpu")
    model.train()
    features = _features(model, rows)
    cfg = _loss_cfg(kind, str(guide_dir))
    padded = build_loss(model, cfg, mbs, unpad=False)
    packed = build_loss(model, cfg, mbs, unpad=True)
    spy = EncoderSpy(model)
    try:
        loss, grads = _step(packed.module, features)
    finally:
        spy.remove()
    assert spy.packed == len(spy.calls) == 2 * 2 * (rows // mbs)  # it really ran the packs
    ref_loss, ref_grads = _step(padded.module, features)
    assert ref_grads.abs().sum() > 0
    assert packed.token_counts.processed < padded.token_counts.processed
    assert rel_diff(loss, ref_loss) <= 2e-6, (loss, ref_loss)
    assert rel_diff(grads, ref_grads) <= 2e-5, rel_diff(grads, ref_grads)
    # row by row: a wrong position or a leaking row shows in the embeddings themselves
    with torch.no_grad():
        for feature in features:
            rows_ref = _embed(padded.cached_module, feature, mbs)
            rows_packed = _embed(packed.cached_module, feature, mbs)
            worst = ((rows_packed - rows_ref).norm(dim=1) / rows_ref.norm(dim=1)).max().item()
            assert worst <= 1e-5, worst


def _embed(loss, feature: dict, mbs: int) -> torch.Tensor:
    """The loss's own no-grad embeddings of a column (its mini-batches, its path), in row order."""
    reps = [r for r, *_ in loss.embed_minibatch_iter(dict(feature), False, False, ranges=_cut(feature, mbs))]
    return torch.cat(reps)


def _cut(feature: dict, mbs: int) -> list[tuple[int, int]]:
    n = feature["input_ids"].shape[0]
    return [(b, min(b + mbs, n)) for b in range(0, n, mbs)]


class _Bypass:
    """A future mixin that embeds mini-batches its own way, without the length-sorted iterator."""

    def embed_minibatch_iter(self, sentence_feature, with_grad, copy_random_state, random_states=None, ranges=None):
        return CachedLossMixin.embed_minibatch_iter(
            self, sentence_feature, with_grad, copy_random_state, random_states, ranges
        )


class BypassingLoss(_Bypass, LengthSortedCachedMNRL):
    pass


def test_a_loss_that_bypasses_packing_is_refused_not_misreported(model_dir):
    """A cached loss whose mini-batches reach the model without the packing (here a mixin in front
    that iterates them itself) fails its step instead of reporting packed rows it did not run."""
    model = SentenceTransformer(str(model_dir), device="cpu")
    model.train()
    loss = BypassingLoss(model, mini_batch_size=6, unpad=True)
    assert loss.unpadding.enabled
    with pytest.raises(RuntimeError, match="planned packed"):
        loss([dict(f) for f in _features(model, 20)], None)


# ----------------------------------------------------------------------------------------------
# The step's state after backward, and calculate_loss after a forward


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["cached_mnrl", "self_guided"])
@pytest.mark.parametrize("unpad", [True, False])
def test_step_state_released_after_backward(model_dir, guide_dir, monkeypatch, kind, unpad):
    """After ``loss.backward()`` (and the caller dropping its loss tensor and inputs) nothing of the
    step stays alive through the loss module: not the column tensors it was given, not their
    length-sorted copies, not the row orders, not the packing plans' index tensors.

    Before the fix, with packing the registry held the sorted copies and the plans until the next
    forward (and ``_inverse`` the orders, with packing or without)."""
    model = SentenceTransformer(str(model_dir), device="cpu")
    model.train()
    module = build_loss(model, _loss_cfg(kind, str(guide_dir)), 8, unpad=unpad).module
    watched: list[weakref.ref] = []

    original_sort = LengthSortedMixin.sort_rows

    def sort_rows(self, features):
        out = original_sort(self, features)
        watched.extend(weakref.ref(v) for f in out for v in f.values() if isinstance(v, torch.Tensor))
        watched.extend(weakref.ref(inv) for inv in self._inverse if inv is not None)
        return out

    original_plan = unpad_module.plan_packing

    def plan_packing(*args, **kwargs):
        plan = original_plan(*args, **kwargs)
        watched.extend(weakref.ref(t) for t in (plan.gather, plan.scatter, plan.segments, plan.positions))
        return plan

    monkeypatch.setattr(LengthSortedMixin, "sort_rows", sort_rows)
    monkeypatch.setattr(unpad_module, "plan_packing", plan_packing)
    features = [
        {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in f.items()} for f in _features(model, 20)
    ]
    watched.extend(weakref.ref(v) for f in features for v in f.values() if isinstance(v, torch.Tensor))
    loss = module(features, None)
    del features
    loss.backward()
    del loss
    gc.collect()
    alive = sum(ref() is not None for ref in watched)
    assert len(watched) >= 6 + 6 + 2 + (4 * 3 * 2 if unpad else 0)
    assert alive == 0, f"{alive} of {len(watched)} step tensors alive after backward"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["cached_mnrl", "self_guided"])
def test_calculate_loss_never_reuses_a_forwards_row_order(model_dir, guide_dir, kind):
    """``calculate_loss`` on given embeddings gives the same value on a fresh loss and right after a
    forward on other inputs (before the fix it reordered them by that forward's sort: 0.727 vs 1.891)."""
    model = SentenceTransformer(str(model_dir), device="cpu")
    model.train()
    cfg = _loss_cfg(kind, str(guide_dir))
    torch.manual_seed(0)
    reps = [[torch.randn(20, 32)], [torch.randn(20, 32)]]
    guided = [[r[0].clone()] for r in reps]
    args = (reps,) if kind == "cached_mnrl" else (reps, guided)
    fresh = build_loss(model, cfg, 8).module.calculate_loss(*args)
    used = build_loss(model, cfg, 8).module
    with torch.no_grad():
        used([dict(f) for f in _features(model, 20)], None)  # rows of mixed lengths: sorting reorders them
    after = used.calculate_loss(*args)
    assert torch.allclose(after, fresh, rtol=1e-6), f"{after.item():.4f} after a forward, {fresh.item():.4f} fresh"
