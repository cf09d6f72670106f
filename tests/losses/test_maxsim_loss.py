"""``cached_maxsim`` equals sentence-transformers' ``CachedMultiVectorMultipleNegativesRankingLoss``
(issue 40 item 2): on the same batch (fp32, dropout off) the loss and every parameter's gradient agree
within 1e-5 relative, for pairs, triplets and three hard negatives, at several scales, whatever the
mini-batch size, token budget, sorting, packing and MaxSim tiles. A copy whose cache is re-padded
(padding tokens cached and scored as tokens) fails the same check."""

from __future__ import annotations

import pytest
import torch

import cembed.losses.cached_maxsim as L
from cembed.config.loss import loss_config
from cembed.config.model import model_config
from cembed.losses.registry import build_loss
from cembed.model.load import load_model

QUERIES = ["a man on a bus", "two dogs", "the red car", "a cat on a table, by the window", "people", "food", "a train!"]
POSITIVES = [
    "a man is riding the bus to the street",
    "dogs playing",
    "a red car near a small white car",
    "cat sitting on the table",
    "people at the street with a dog",
    "a plate of food on a table",
    "train on a track, next to the station",
]
NEGATIVES = [
    [
        f"{w} {i}"
        for i, w in enumerate(["blue room", "black dog", "white car", "bus top", "the table", "a woman", "woman"])
    ],
    ["near", "a large plate", "the bus", "two people sitting", "a white cat", "red", "next to the dog on the street"],
    ["top", "room with chairs", "a man", "table", "cars", "the black train", "dog and cat"],
]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    """A multi-vector model built from the tiny BERT: 16-dim tokens, punctuation skiplisted for documents."""
    cfg = model_config(kind="multi_vector", name_or_path=str(tiny_model_dir), dim=16, skiplist="punctuation")
    return load_model(cfg, "cpu", seed=3).eval()  # dropout 0 anyway: eval only fixes the mode


@pytest.fixture(scope="module")
def expanded_model(tiny_model_dir):
    """The same with ColBERT's query expansion (queries padded with [MASK] to 12 tokens, not attended to)."""
    cfg = model_config(kind="multi_vector", name_or_path=str(tiny_model_dir), dim=16, query_expansion=12)
    return load_model(cfg, "cpu", seed=3).eval()


def columns(model, negatives: int) -> list[dict]:
    texts = [QUERIES, POSITIVES, *NEGATIVES[:negatives]]
    return [model.preprocess(t, task="query" if i == 0 else "document") for i, t in enumerate(texts)]


def grads(model, loss, features):
    model.zero_grad(set_to_none=True)
    value = loss([dict(f) for f in features], None)
    value.backward()
    return value.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def worst_error(model, loss, reference, features) -> float:
    """The largest relative difference of ``loss`` from ``reference``: the loss value, and each parameter's
    gradient as ``||g - g_ref|| / max(||g_ref||, 1e-4 ||all of g_ref||)`` (a parameter whose gradient is
    zero in exact arithmetic, the attention key bias, is compared at that floor instead of its rounding)."""
    value_ref, grads_ref = grads(model, reference, features)
    value, got = grads(model, loss, features)
    assert set(got) == set(grads_ref)
    total = torch.sqrt(sum(g.pow(2).sum() for g in grads_ref.values()))
    errors = [float((value - value_ref).abs() / value_ref.abs())]
    errors += [float((got[n] - g).norm() / torch.maximum(g.norm(), 1e-4 * total)) for n, g in grads_ref.items()]
    return max(errors)


def stock(model, scale):
    from sentence_transformers.multi_vector_encoder.losses import CachedMultiVectorMultipleNegativesRankingLoss

    return CachedMultiVectorMultipleNegativesRankingLoss(model, scale=scale, mini_batch_size=64)


def cembed_loss(model, scale, mini_batch_size=64, budget=None, tiles=(2048, 8192, 2048), **settings):
    cfg = loss_config(
        name="cached_maxsim",
        scale=scale,
        score_query_tokens=tiles[0],
        score_document_tokens=tiles[1],
        score_document_rows=tiles[2],
    )
    return build_loss(model, cfg, mini_batch_size, mini_batch_num_tokens=budget, **settings)


ONE_BATCH = {}
SMALLEST = {"mini_batch_size": 1, "tiles": (1, 2, 1)}  # a row per mini-batch, a query per tile, 2-token tiles
CUT = {"mini_batch_size": 3, "tiles": (7, 5, 2)}  # tiles that cut documents
BUDGET = {"budget": 24, "tiles": (16, 30, 3)}  # token-budget mini-batches
PADDED = {"mini_batch_size": 2, "sort_by_length": False, "unpad": False}


@pytest.mark.parametrize(
    ("negatives", "scale", "settings"),
    [
        pytest.param(0, 1.0, ONE_BATCH, id="pairs-one-mini-batch"),
        pytest.param(0, 1.0, SMALLEST, id="pairs-rows-and-tiles-of-one"),
        pytest.param(1, 5.0, CUT, id="triplets-tiles-cut-documents"),
        pytest.param(1, 5.0, BUDGET, id="triplets-token-budget"),
        pytest.param(3, 0.5, CUT, id="3-neg-tiles-cut-documents"),
        pytest.param(3, 0.5, PADDED, id="3-neg-unsorted-padded"),
    ],
)
def test_equals_the_stock_cached_loss(model, negatives, scale, settings):
    built = cembed_loss(model, scale, **settings)
    assert built.cached and isinstance(built.module, L.CachedMaxSimLoss)
    assert built.unpadding.enabled == (settings.get("unpad", "auto") == "auto"), built.unpadding.description
    assert worst_error(model, built.module, stock(model, scale), columns(model, negatives)) < 1e-5


def test_equals_the_stock_loss_with_query_expansion(expanded_model):
    features = columns(expanded_model, 1)
    assert features[0]["input_ids"].shape[1] == 12 and "query_expansion_positions" in features[0]
    built = cembed_loss(expanded_model, 2.0, mini_batch_size=3, tiles=(9, 11, 2))
    assert worst_error(expanded_model, built.module, stock(expanded_model, 2.0), features) < 1e-5


def test_equals_the_stock_loss_under_meanmaxsim(model):
    model.similarity_fn_name = "meanmaxsim"
    try:
        built = cembed_loss(model, 4.0, mini_batch_size=2, tiles=(5, 9, 2))
        assert worst_error(model, built.module, stock(model, 4.0), columns(model, 1)) < 1e-5
    finally:
        model.similarity_fn_name = "maxsim"


def test_without_gradients_the_loss_is_the_stock_value(model):
    features = columns(model, 1)
    with torch.no_grad():
        mine = cembed_loss(model, 3.0, mini_batch_size=2).module([dict(f) for f in features], None)
        theirs = stock(model, 3.0)([dict(f) for f in features], None)
    assert abs(float(mine) - float(theirs)) <= 1e-5 * abs(float(theirs))


def test_a_re_padded_cache_fails_the_check(model, monkeypatch):
    """Broken copy: every mini-batch cached at its padded width, padding positions kept as tokens."""

    def re_padded(self, sentence_feature, begin, end, with_grad, copy_random_state, random_state=None):
        embeddings, mask, state = super(L.CachedMaxSimLoss, self).embed_minibatch(
            sentence_feature, begin, end, with_grad, copy_random_state, random_state
        )
        rows, width, dim = embeddings.shape
        return embeddings.reshape(rows * width, dim), torch.full((rows,), width), state

    monkeypatch.setattr(L.CachedMaxSimLoss, "embed_minibatch", re_padded)
    built = cembed_loss(model, 1.0, mini_batch_size=3)
    assert worst_error(model, built.module, stock(model, 1.0), columns(model, 1)) > 1e-3


def test_the_cache_is_never_concatenated(model, monkeypatch):
    # The loss reads the cached mini-batches in place: no tensor as long as a whole column of the cache is
    # made (the old code concatenated each column, a copy of the cache). Every concatenation is of one
    # tile at most (tiles of 5 document tokens, 3 query tokens... here: at most 7 rows).
    features = columns(model, 1)
    loss = cembed_loss(model, 5.0, **CUT).module
    cache_rows = []
    real_cat = torch.cat

    def cat(tensors, *args, **kwargs):
        out = real_cat(tensors, *args, **kwargs)
        if out.dim() == 2 and out.shape[1] == 16:  # token vectors (dim 16)
            cache_rows.append(out.shape[0])
        return out

    monkeypatch.setattr(torch, "cat", cat)
    value = loss([dict(f) for f in features], None)
    value.backward()
    assert cache_rows and max(cache_rows) <= 7
