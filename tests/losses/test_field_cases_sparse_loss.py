"""Field cases (issue 41's round) for the sparse kind's loss, ``cached_splade``: each built from a public
bug report about SPLADE training in sentence-transformers, Tevatron or neural-cherche, tried as a new user
would and compared with a reference computed without cembed (sentence-transformers' ``CachedSpladeLoss``,
the FLOPS regularizer by hand, the float32 loss). docs/development.md lists the round."""

from __future__ import annotations

import pytest
import torch
from conftest import TEXTS, make_tiny_splade, rel_diff
from sentence_transformers.sparse_encoder.losses import CachedSpladeLoss, SparseMultipleNegativesRankingLoss
from transformers import TrainerControl, TrainerState

from cembed.config.loss import CachedSpladeLossConfig
from cembed.losses.cached_splade import SparseCachedSpladeLoss
from cembed.losses.registry import LossSettings
from cembed.losses.splade import build_cached_splade

PAIRS = ("anchor", "positive")


def _step(model, loss, feats, seed: int = 0, autocast: torch.dtype | None = None):
    """One forward and backward from ``seed``: (the summed loss, its parts, every parameter's gradient)."""
    model.zero_grad()
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        parts = loss(feats, None)
    total = sum(parts.values())
    total.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return total.detach(), {k: float(v.detach()) for k, v in parts.items()}, grads


def _worst(grads, ref) -> float:
    return max(
        (torch.linalg.vector_norm(grads[k] - g) / torch.linalg.vector_norm(g)).item()
        for k, g in ref.items()
        if torch.linalg.vector_norm(g) > 1e-8
    )


def test_dropout_is_replayed_as_stock_replays_it(tmp_path):
    """sentence-transformers#3862 ("fix silently wrong gradients": GradCache's second pass must replay
    the first pass's dropout; its dropout-replay tests were the first to run with dropout on). A SPLADE
    model with dropout 0.2 in train mode, mini-batches of 3: cembed's loss and gradients equal stock
    ``CachedSpladeLoss``'s from the same seed (which replays each mini-batch's random state)."""
    model = make_tiny_splade(tmp_path, bias=-0.1, dropout=0.2).train()
    feats = [model.preprocess(TEXTS[c]) for c in PAIRS]
    kwargs = dict(document_regularizer_weight=0.3, query_regularizer_weight=0.4, mini_batch_size=3)
    stock = _step(model, CachedSpladeLoss(model, SparseMultipleNegativesRankingLoss(model), **kwargs), feats, seed=1)
    ours = _step(model, SparseCachedSpladeLoss(model, SparseMultipleNegativesRankingLoss(model), **kwargs), feats, 1)
    other_seed = _step(model, CachedSpladeLoss(model, SparseMultipleNegativesRankingLoss(model), **kwargs), feats, 2)
    assert rel_diff(ours[0], stock[0]) <= 1e-6
    assert _worst(ours[2], stock[2]) <= 1e-5
    assert rel_diff(other_seed[0], stock[0]) > 1e-4  # dropout is on: another seed is another loss


def test_dense_rows_under_half_precision_autocast_give_a_finite_loss(tmp_path):
    """sentence-transformers#3431 ("Having trouble training sparse embedding models": every one of 31,999
    dimensions active) and #3670's first logged losses (944,862): a fresh masked-language model's rows are
    dense, and their dot products exceed float16's 65,504. Under float16 autocast the loss keeps the dense
    form for such a mini-batch (the sparse one would not pay); its scores must still be taken in float32,
    as the sparse form's are. Reference: the loss by hand in float64 from the same float16 rows (stock
    ``CachedSpladeLoss`` gives NaN under float16 autocast here)."""
    model = make_tiny_splade(tmp_path, bias=50.0, width=8192).train()  # every coordinate active, log1p(51) each
    feats = [model.preprocess(TEXTS[c]) for c in PAIRS]
    with torch.no_grad():
        rows = model(feats[0])["sentence_embedding"]
    assert bool((rows != 0).all()) and (rows @ rows.T).max() > 65504  # dense, beyond float16
    kwargs = dict(document_regularizer_weight=3e-5, query_regularizer_weight=5e-5, mini_batch_size=3)
    loss = SparseCachedSpladeLoss(model, SparseMultipleNegativesRankingLoss(model), **kwargs)
    half = _step(model, loss, feats, autocast=torch.float16)
    assert loss.sparse_counts.dense_minibatches > 0  # the dense form was taken
    assert torch.isfinite(half[0]) and all(torch.isfinite(g).all() for g in half[2].values())
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        q, d = (model(f)["sentence_embedding"] for f in feats)
    assert q.dtype == torch.float16  # the rows the loss caches
    q, d = q.double(), d.double()
    scores = q @ d.T
    by_hand = (torch.logsumexp(scores, dim=1) - scores.diagonal()).mean()
    by_hand += 3e-5 * (d.mean(dim=0) ** 2).sum() + 5e-5 * (q.mean(dim=0) ** 2).sum()
    # float32 scores of about 1.3e5 carry about 0.01 each (its spacing there is 0.0078): 4e-4 of this loss
    assert rel_diff(half[0].double(), by_hand) <= 1e-3


def test_query_and_document_flops_weights_are_each_their_own(tmp_path):
    """texttron/tevatron#44 ("it uses the same regularization parameter for both query and passage
    instead of using separate ones") and raphaelsty/neural-cherche#41 ("Flops regularizer looks odd": not
    the paper's formula). ``cached_splade`` built from a config with lambda_d 0.05, lambda_q 0.2 and a
    document threshold, past its warm-up: each regularizer term is its own weight times
    ``sum_j (mean_i w_ij)^2`` over its own column's rows (documents with at most the threshold's active
    dimensions counted as zero rows), by hand from the model's embeddings."""
    model = make_tiny_splade(tmp_path, bias=-0.1).train()
    feats = [model.preprocess(TEXTS[c]) for c in PAIRS]
    with torch.no_grad():
        queries, documents = (model(f)["sentence_embedding"] for f in feats)
    threshold = int((documents != 0).sum(dim=1).median())
    cfg = CachedSpladeLossConfig(
        document_regularizer_weight=0.05,
        query_regularizer_weight=0.2,
        document_regularizer_threshold=threshold,
        regularizer_warmup_ratio=0.5,
    )
    loss = build_cached_splade(model, cfg, LossSettings(mini_batch_size=3))
    (warmup,) = loss.trainer_callbacks
    state, control = TrainerState(max_steps=10), TrainerControl()
    warmup.on_train_begin(None, state, control)
    state.global_step = 6  # past the warm-up (5 steps): the full weights
    warmup.on_step_begin(None, state, control)
    with torch.no_grad():
        loss(feats, None)
    kept = documents * ((documents != 0).sum(dim=1) > threshold).unsqueeze(1)
    assert 0 < int(((kept != 0).sum(dim=1) > 0).sum()) < len(documents)  # the threshold leaves some rows out

    def flops(rows):
        return float((rows.mean(dim=0) ** 2).sum())

    parts = loss._component_values
    assert parts["document_regularizer_loss"] == pytest.approx(0.05 * flops(kept), rel=1e-5)
    assert parts["query_regularizer_loss"] == pytest.approx(0.2 * flops(queries), rel=1e-5)
