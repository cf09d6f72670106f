"""Token-budget mini-batches (batch.mini_batch_num_tokens): ranges by rows x padded width, the
result independent of them, and the probe's budget from the longest-rows worst case."""

from __future__ import annotations

import pytest
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.losses.gradcache import _minibatch_ranges

from cembed.config import loss_config
from cembed.losses import build_loss
from cembed.token_budget import padded_ranges, row_extents, token_budget_ranges

# Lengths (in words) from long to short with a gap: the case where counting non-padding tokens
# would pad many short rows to a long row's width.
WORDS = [40, 38, 37, 30, 12, 11, 10, 9, 6, 5, 5, 4, 3, 3, 2, 2, 1, 1, 1, 1]


def _texts(lengths, offset=0):
    vocab = "man woman dog cat train table street car room plate food bus".split()
    return [" ".join(vocab[(i + j + offset) % len(vocab)] for j in range(n)) for i, n in enumerate(lengths)]


def _loss_and_grads(model, loss, features):
    model.zero_grad()
    value = loss(features, labels=None)
    value.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return value.detach(), grads


def _rel(a, b):
    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b)).item()


def test_padded_ranges_exact():
    # sorted longest first: each range takes budget // first width rows
    assert padded_ranges([10, 10, 10, 5, 5, 5, 5, 2, 2, 2, 2, 2], 20) == [(0, 2), (2, 4), (4, 8), (8, 12)]
    # a row wider than the budget forms its own range
    assert padded_ranges([30, 4, 4], 8) == [(0, 1), (1, 3)]
    # unsorted: the widest row of a range sets its width (3 x 9 > 20, so the 9 starts a new range)
    assert padded_ranges([2, 2, 9, 2, 2, 2], 20) == [(0, 2), (2, 4), (4, 6)]
    assert padded_ranges([], 5) == []
    with pytest.raises(ValueError, match="at least 1"):
        padded_ranges([1], 0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [0, 1, 1, 1]])  # the last: left padding
    assert row_extents(mask).tolist() == [3, 1, 4, 4]
    assert token_budget_ranges({"input_ids": torch.zeros(3, 4)}, 8) is None


def test_every_range_within_budget_and_maximal():
    g = torch.Generator().manual_seed(0)
    for budget in (1, 7, 16, 50, 200):
        ext = torch.randint(1, 33, (300,), generator=g).tolist()
        for extents in (ext, sorted(ext, reverse=True)):
            ranges = padded_ranges(extents, budget)
            assert ranges[0][0] == 0 and ranges[-1][1] == len(extents)
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            for b, e in ranges:
                width = max(extents[b:e])
                assert (e - b) * width <= budget or e - b == 1
                if e < len(extents):  # one more row would not fit
                    assert (e + 1 - b) * max(extents[b : e + 1]) > budget


def test_short_rows_get_larger_minibatches(tiny_model_dir):
    """On a concrete sorted batch: the budget's mini-batches hold few long rows and many short ones,
    each within rows x padded width <= budget; the library's non-padding count would pad short rows
    to a long width (more positions than the budget)."""
    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    feature = model.tokenize(_texts(WORDS))
    lengths = feature["attention_mask"].sum(dim=1).tolist()
    assert lengths == sorted(lengths, reverse=True) and lengths[0] == 42 and lengths[-1] == 3  # [CLS] .. [SEP]
    # tokens: 42 40 | 39 32 | 14 13 12 11 8 7 | 7 6 5 5 4 4 3 3 3 3: 90 // 42 = 2, 90 // 39 = 2,
    # 90 // 14 = 6 and 90 // 7 = 12 rows (the last 10)
    ranges = token_budget_ranges(feature, 90)
    assert ranges == [(0, 2), (2, 4), (4, 10), (10, 20)]
    for b, e in ranges:
        assert (e - b) * lengths[b] <= 90
    library = _minibatch_ranges(feature, 4, 90)  # counts non-padding tokens
    assert max((e - b) * max(lengths[b:e]) for b, e in library) > 90  # e.g. the 32-token row + short ones


@pytest.mark.parametrize(("budget", "sort"), [(1, True), (45, True), (90, False), (10_000, True)])
def test_budget_gives_the_same_loss_and_gradients(tiny_model_dir, budget, sort):
    """fp32: the loss and gradients with a token budget equal the plain (one-pass) loss's and the
    row-cut cached loss's to 1e-5 relative, whatever the budget."""
    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    model.train()
    features = [model.tokenize(_texts(WORDS)), model.tokenize(_texts(list(reversed(WORDS)), offset=3))]
    ref_loss, ref_grads = _loss_and_grads(model, build_loss(model, loss_config(name="mnrl"), 1).module, features)
    rows_loss, rows_grads = _loss_and_grads(model, build_loss(model, loss_config(), 4).module, features)
    built = build_loss(model, loss_config(), 4, mini_batch_num_tokens=budget, sort_by_length=sort)
    loss, grads = _loss_and_grads(model, built.module, features)
    assert _rel(loss, ref_loss) <= 1e-5 and _rel(grads, ref_grads) <= 1e-5
    assert _rel(loss, rows_loss) <= 1e-5 and _rel(grads, rows_grads) <= 1e-5
    real = sum(int(f["attention_mask"].sum()) for f in features)
    assert built.token_counts.real == real
    if budget == 1:  # one row per mini-batch: nothing padded
        assert built.token_counts.processed == real


def test_budget_passes_replay_the_same_ranges(tiny_model_dir, monkeypatch):
    """The no-grad pass and the backward replay embed the same mini-batches: the budget's."""
    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    model.train()
    features = [model.tokenize(_texts(WORDS)), model.tokenize(_texts(WORDS, offset=5))]
    module = build_loss(model, loss_config(), 4, mini_batch_num_tokens=90).module
    seen = []
    original = type(module).__mro__[2].embed_minibatch  # the library's (after the mixin and the loss)

    def record(self, sentence_feature, begin, end, with_grad, *args, **kwargs):
        seen.append((with_grad, begin, end))
        return original(self, sentence_feature, begin, end, with_grad, *args, **kwargs)

    monkeypatch.setattr(type(module).__mro__[2], "embed_minibatch", record)
    module(features, None).backward()
    expected = [(0, 2), (2, 4), (4, 10), (10, 20)] * 2  # both columns have the WORDS lengths
    assert [(b, e) for g, b, e in seen if not g] == expected
    assert [(b, e) for g, b, e in seen if g] == expected
