"""The training result must not depend on mini_batch_size: cached loss == plain loss. A loss
registered from outside cembed trains through the same path as the built-in ones."""

from __future__ import annotations

from typing import ClassVar, Literal

import pytest
import torch
from conftest import TEXTS, distinct_pairs, features_for, loss_and_grads, rel_diff
from pydantic import PositiveFloat
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.losses.gradcache import _create_minibatch
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

from cembed.config.file import config_from_dict, load_config
from cembed.config.loss import LOSS_CONFIGS, CachedMNRLLossConfig, MNRLLossConfig, MNRLOptionsConfig, loss_config
from cembed.errors import UserError
from cembed.losses.mnrl import CountingMNRL, LengthSortedCachedMNRL
from cembed.losses.registry import LOSS_BUILDERS, build_loss, register_loss
from cembed.train.recipe import check_run_inputs, run_training


@pytest.mark.slow
@pytest.mark.parametrize("columns", [("anchor", "positive"), ("anchor", "positive", "negative_1")])
@pytest.mark.parametrize("symmetric", [False, True])
def test_cached_equals_plain_without_dropout(tiny_model_dir, columns, symmetric):
    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    model.train()
    features = features_for(model, columns)
    cfg = MNRLLossConfig(symmetric=symmetric)
    ref_loss, ref_grads = loss_and_grads(model, build_loss(model, cfg, 1).module, features)
    assert ref_grads.abs().sum() > 0
    for mbs in (1, 3, len(TEXTS["anchor"])):
        cached = build_loss(model, CachedMNRLLossConfig(symmetric=symmetric), mbs).module
        loss, grads = loss_and_grads(model, cached, features)
        assert rel_diff(loss, ref_loss) <= 1e-5, mbs
        assert rel_diff(grads, ref_grads) <= 1e-5, mbs


@pytest.mark.parametrize("mbs", [1, 3, 7])
def test_cached_equals_plain_under_same_dropout_masks(tiny_dropout_model_dir, mbs):
    """With dropout on, the cached loss replays each mini-batch's RNG state in its second forward.
    The reference embeds the same mini-batches in the same order from the same seed (so it draws
    the same masks) with gradients, and applies the plain loss to the concatenated embeddings."""
    model = SentenceTransformer(str(tiny_dropout_model_dir), device="cpu")
    model.train()
    columns = ("anchor", "positive")
    features = features_for(model, columns)
    n = len(TEXTS["anchor"])
    plain = MultipleNegativesRankingLoss(model)

    model.zero_grad()
    torch.manual_seed(123)
    reps = []
    for feat in features:
        # Same slicing as the cached loss (it also trims trailing padding, which changes mask shapes).
        chunks = [model(_create_minibatch(feat, b, b + mbs))["sentence_embedding"] for b in range(0, n, mbs)]
        reps.append(torch.cat(chunks))
    ref_loss = plain.compute_loss_from_embeddings(reps, None)
    ref_loss.backward()
    ref_grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    # Padded mini-batches, as the reference embeds them (the packed replay: tests/model/test_unpad.py).
    cached = build_loss(model, loss_config(), mbs, sort_by_length=False, unpad=False).module
    torch.manual_seed(123)
    loss, grads = loss_and_grads(model, cached, features)
    assert rel_diff(loss, ref_loss.detach()) <= 1e-5
    assert rel_diff(grads, ref_grads) <= 1e-5

    # Sanity: dropout is really on, so a different seed changes the gradients.
    torch.manual_seed(999)
    _, other = loss_and_grads(model, cached, features)
    assert rel_diff(other, ref_grads) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("mbs", [1, 3, 7])
@pytest.mark.parametrize("columns", [("anchor", "positive"), ("anchor", "positive", "negative_1")])
def test_length_sorted_equals_unsorted(tiny_model_dir, mbs, columns):
    """Sorting rows by length before cutting mini-batches changes neither loss nor gradients."""
    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    model.train()
    features = features_for(model, columns)
    unsorted_loss, unsorted_grads = loss_and_grads(
        model, build_loss(model, loss_config(), mbs, sort_by_length=False).module, features
    )
    sorted_obj = build_loss(model, loss_config(), mbs, sort_by_length=True)
    sorted_loss, sorted_grads = loss_and_grads(model, sorted_obj.module, features)
    assert rel_diff(sorted_loss, unsorted_loss) <= 1e-5
    assert rel_diff(sorted_grads, unsorted_grads) <= 1e-5
    counts = sorted_obj.token_counts
    real = sum(int(f["attention_mask"].sum()) for f in features)
    assert counts.real == real and counts.processed >= real
    if mbs == 1:
        assert counts.processed == real  # one row per mini-batch: no padding at all


def test_sorting_reduces_padded_positions(tiny_model_dir):
    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    texts = [("word " * (1 + (i * 7) % 23)).strip() for i in range(32)]
    features = [model.tokenize(texts), model.tokenize(list(reversed(texts)))]
    on, off = (build_loss(model, loss_config(), 4, sort_by_length=s).module for s in (True, False))
    with torch.no_grad():
        on(features, None)
        off(features, None)
    assert on.token_counts.real == off.token_counts.real
    assert on.token_counts.processed < off.token_counts.processed


def test_token_budget_minibatches(tiny_model_dir):
    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    model.train()
    features = features_for(model, ("anchor", "positive"))
    ref_loss, ref_grads = loss_and_grads(model, build_loss(model, loss_config(name="mnrl"), 1).module, features)
    loss, grads = loss_and_grads(model, build_loss(model, loss_config(), 7, mini_batch_num_tokens=20).module, features)
    assert rel_diff(loss, ref_loss) <= 1e-5 and rel_diff(grads, ref_grads) <= 1e-5


# ----------------------------------------------------------------------------------------------
# The extension point: a loss defined outside cembed, registered only through register_loss.


class ScaledMNRLConfig(MNRLOptionsConfig):
    """A third loss for the test: the plain loss with its scale multiplied by ``factor``."""

    uses_gradient_cache: ClassVar[bool] = False

    name: Literal["scaled_mnrl"] = "scaled_mnrl"
    factor: PositiveFloat = 1.0


@pytest.fixture
def scaled_mnrl():
    """Register ``scaled_mnrl`` for one test; yields the configs its builder was called with."""
    calls = []

    def build(model, cfg, settings):
        calls.append(cfg)
        return CountingMNRL(model, scale=cfg.scale * cfg.factor, directions=cfg.resolved_directions())

    register_loss(ScaledMNRLConfig, build)
    try:
        yield calls
    finally:
        LOSS_CONFIGS.pop("scaled_mnrl", None)
        LOSS_BUILDERS.pop("scaled_mnrl", None)


def _loss_config(tiny_model_dir, pairs_file, tmp_path, loss: dict) -> dict:
    return {
        "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
        "data": {"train": str(pairs_file(distinct_pairs(32))), "pretokenize": False},
        "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 8},
        "loss": loss,
        "train": {"max_steps": 1, "logging_steps": 1, "output_dir": str(tmp_path / "run")},
    }


@pytest.mark.slow
def test_registered_loss_trains_through_the_registry(scaled_mnrl, tiny_model_dir, pairs_file, tmp_path):
    data = _loss_config(tiny_model_dir, pairs_file, tmp_path, {"name": "scaled_mnrl", "factor": 2})
    cfg = config_from_dict(data, base=tmp_path)
    assert type(cfg.loss) is ScaledMNRLConfig and cfg.loss.factor == 2
    plan, prepared = check_run_inputs(cfg)
    summary = run_training(cfg, plan, prepared)
    assert summary["status"] == "completed" and summary["steps"] == 1
    assert len(scaled_mnrl) == 1 and isinstance(scaled_mnrl[0], ScaledMNRLConfig) and scaled_mnrl[0].factor == 2
    assert summary["config"]["loss"]["factor"] == 2  # the subclass's own fields reach run_summary.json
    # did-you-mean knows the registered class's fields
    data["loss"] = {"name": "scaled_mnrl", "facter": 2}
    with pytest.raises(UserError, match=r"unknown key 'loss.facter'; did you mean 'loss.factor'\?"):
        config_from_dict(data, base=tmp_path)


def test_unknown_loss_name_lists_known_names(write_config):
    text = "data:\n  train: pairs.jsonl\nloss:\n  name: infonce\n"
    with pytest.raises(UserError) as err:
        load_config(write_config(text))
    msg = str(err.value)
    assert ":4: loss.name: unknown loss 'infonce'" in msg
    assert "cached_mnrl" in msg and "mnrl" in msg
    with pytest.raises(ValueError, match=r"unknown loss 'infonce'; known: cached_mnrl, mnrl"):
        loss_config(name="infonce")


def test_loss_field_errors_keep_their_line(write_config):
    path = write_config("data:\n  train: pairs.jsonl\nloss:\n  name: mnrl\n  scale: -1\n")
    with pytest.raises(UserError, match=rf"{path}:5: loss\.scale: .*greater than 0"):
        load_config(path)
    with pytest.raises(UserError, match=r":4: loss\.scale: .*greater than 0"):
        load_config(write_config("data:\n  train: pairs.jsonl\nloss:\n  scale: -1\n"))


def test_built_loss_reports_caching(tiny_model_dir):
    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    cached, plain = build_loss(model, loss_config(), 4), build_loss(model, loss_config(name="mnrl"), 4)
    assert cached.cached and isinstance(cached.module, LengthSortedCachedMNRL)
    assert not plain.cached and isinstance(plain.module, CountingMNRL)
    assert cached.token_counts is cached.module.token_counts
    assert CachedMNRLLossConfig.uses_gradient_cache and not MNRLLossConfig.uses_gradient_cache


def test_resolved_directions_follow_symmetric_unless_set():
    """The one rule for an MNRL loss's directions (the builders pass it to the library)."""
    assert MNRLLossConfig().resolved_directions() == ("query_to_doc",)
    assert MNRLLossConfig(symmetric=True).resolved_directions() == ("query_to_doc", "doc_to_query")
    dirs = CachedMNRLLossConfig(directions=["query_to_doc", "query_to_query"]).resolved_directions()
    assert dirs == ("query_to_doc", "query_to_query")
