"""``loss.name: cached_splade`` (issue 41 item 2): the registered loss, with cembed's length-sorted,
token-budget and packed mini-batches, gives sentence-transformers' ``CachedSpladeLoss`` numbers (loss and
every parameter's gradient) on the same batch; the sorted rows are put back in order as sparse rows; the
packing plans live until the GradCache replay (a dict-valued loss); the loss declares the sparse kind
(refused for a dense model); the warm-up callback comes with it."""

from __future__ import annotations

import pytest
import torch
from conftest import TEXTS, make_tiny_splade
from sentence_transformers.sparse_encoder.callbacks.splade_callbacks import SpladeRegularizerWeightSchedulerCallback
from sentence_transformers.sparse_encoder.losses import CachedSpladeLoss, SparseMultipleNegativesRankingLoss

from cembed.config.loss import loss_config
from cembed.losses.registry import build_loss
from cembed.losses.reps import TENSOR_ROWS, inverse_permutation
from cembed.losses.sparse_rows import SparseRows
from tests.losses.test_cached_splade import assert_matches, step

TRIPLETS = ("anchor", "positive", "negative_1")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    splade = make_tiny_splade(tmp_path_factory.mktemp("splade"), bias=-0.1)
    splade.train()
    return splade


def _features(model):
    return [model.preprocess(TEXTS[c]) for c in TRIPLETS]


def _stock(model):
    base = SparseMultipleNegativesRankingLoss(model, directions=("query_to_doc", "doc_to_query"))
    return CachedSpladeLoss(
        model,
        base,
        document_regularizer_weight=0.3,
        query_regularizer_weight=0.4,
        document_regularizer_threshold=2,
        mini_batch_size=3,
    )


def _ours(model, **settings):
    cfg = loss_config(
        name="cached_splade",
        directions=["query_to_doc", "doc_to_query"],
        document_regularizer_weight=0.3,
        query_regularizer_weight=0.4,
        document_regularizer_threshold=2,
    )
    return build_loss(model, cfg, mini_batch_size=3, **settings)


@pytest.mark.parametrize(
    "settings",
    [
        pytest.param({"sort_by_length": True, "unpad": False}, id="sorted"),
        pytest.param({"sort_by_length": True, "unpad": False, "mini_batch_num_tokens": 14}, id="token-budget"),
        pytest.param({"sort_by_length": True, "unpad": True}, id="packed"),
    ],
)
def test_the_registered_loss_equals_stock(model, settings, monkeypatch):
    import cembed.model.unpad as unpad

    plans = []
    plan_packing = unpad.plan_packing
    monkeypatch.setattr(unpad, "plan_packing", lambda *a, **k: plans.append(1) or plan_packing(*a, **k))
    feats = _features(model)
    lengths = feats[0]["attention_mask"].sum(dim=1)
    assert not torch.equal(
        lengths.argsort(descending=True, stable=True), torch.arange(len(lengths))
    )  # sorting moves rows
    ref_loss, ref_grads = step(model, _stock(model), feats)
    built = _ours(model, **settings)
    plans.clear()  # the start-up packing check plans its own rows
    assert built.cached and built.unpadding.enabled == settings["unpad"]
    loss, grads = step(model, built.module, _features(model))
    assert_matches(loss, grads, ref_loss, ref_grads, 1e-5)
    if settings["unpad"]:  # the replay ran packed on the forward's plans: they outlive the dict-valued loss
        mini_batches = sum(len(r) for r in map(built.cached_module.column_ranges, feats))
        assert built.cached_module._packed_runs == 2 * mini_batches
        assert len(plans) == mini_batches  # planned once, not again for the replay


def test_sparse_rows_are_reordered_as_dense_rows_would_be():
    torch.manual_seed(0)
    dense = torch.relu(torch.randn(6, 9) - 0.8)
    dense[3] = 0.0  # an empty row
    order = torch.tensor([4, 0, 3, 5, 1, 2])
    rows = SparseRows.from_dense(dense, "sparse")
    taken = rows.take(order)
    assert taken.is_sparse and torch.equal(taken.to_dense(), dense[order])
    back = taken.take(inverse_permutation(order))
    assert torch.equal(back.to_dense(), dense) and torch.equal(back.crow, rows.crow)
    assert torch.equal(TENSOR_ROWS.take(dense, order), dense[order])


def test_the_loss_trains_the_sparse_kind_only_and_brings_its_warmup(model):
    cfg = loss_config(name="cached_splade", regularizer_warmup_ratio=0.5, regularizer_schedule="linear")
    assert cfg.consumes == frozenset({"sparse_vector"}) and cfg.scale == 1.0
    built = build_loss(model, cfg, mini_batch_size=4)
    (callback,) = built.module.trainer_callbacks
    assert isinstance(callback, SpladeRegularizerWeightSchedulerCallback) and callback.loss is built.module
    assert (callback.warmup_ratio, callback.scheduler_type.value) == (0.5, "linear")
    assert (callback.max_document_regularizer_weight, callback.max_query_regularizer_weight) == (3e-5, 5e-5)
    for bad, words in (
        ({"hardness_mode": "all_negatives", "hardness_strength": 5}, "hardness_mode is not an option of cached_splade"),
        ({"regularizer_warmup_ratio": 0}, "greater than 0"),
        ({"query_regularizer_weight": None, "query_regularizer_threshold": 3}, "needs query_regularizer_weight"),
    ):
        with pytest.raises(ValueError, match=words):
            loss_config(name="cached_splade", **bad)
