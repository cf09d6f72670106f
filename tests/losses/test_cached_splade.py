"""The sparse cached SPLADE loss (cembed/losses/cached_splade.py) gives sentence-transformers'
``CachedSpladeLoss`` numbers: the loss and every parameter's gradient, on the same batch, for pairs and
triplets, both SPLADE activations, FLOPS on documents only / documents and queries / with thresholds,
and the four MNRL directions. Its sparse cache gives the dense cache's gradients at row densities from
1 % to 100 % of the vocabulary; a cache that drops a row's last active coordinate is caught. The
regularizer warm-up callback drives it; unsupported pieces are refused.
(Two ranks against one process: tests/losses/test_cached_splade_ranks.py.)"""

from __future__ import annotations

import pytest
import torch
from conftest import TEXTS, make_tiny_splade, rel_diff
from sentence_transformers.sparse_encoder.callbacks.splade_callbacks import SpladeRegularizerWeightSchedulerCallback
from sentence_transformers.sparse_encoder.losses import (
    CachedSpladeLoss,
    FlopsLoss,
    SparseMultipleNegativesRankingLoss,
)
from sentence_transformers.util import cos_sim
from transformers import TrainerControl, TrainerState

import cembed.losses.cached_splade as cached_splade
from cembed.losses.cached_splade import SparseCachedSpladeLoss
from cembed.losses.sparse_rows import SparseRows

PAIRS, TRIPLETS = ("anchor", "positive"), ("anchor", "positive", "negative_1")
ALL_DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
MINI = 3  # 7 rows: mini-batches (and score chunks) of 3, 3, 1


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """One tiny SPLADE per activation, its MLM bias lowered so rows are about half active: some
    mini-batches are kept sparse and some dense by ``cache_form: auto``."""
    return {
        act: make_tiny_splade(tmp_path_factory.mktemp(f"splade_{act}"), activation=act, bias=-0.1)
        for act in ("relu", "log1p_relu")
    }


def features(model, columns):
    return [model.preprocess(TEXTS[c]) for c in columns]


def step(model, loss, feats) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The summed loss (as the trainer sums a dict-valued loss) and each parameter's gradient after one backward."""
    model.zero_grad()
    parts = loss(feats, None)
    total = sum(parts.values())
    total.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return total.detach(), grads


def median_active(model, feats) -> int:
    with torch.no_grad():
        reps = torch.cat([model(f)["sentence_embedding"] for f in feats])
    return int((reps != 0).sum(dim=1).median())


def regularizer_kwargs(setting: str, threshold: int) -> dict:
    if setting == "documents":
        return dict(query_regularizer_weight=None)
    if setting == "documents_and_queries":
        return dict(query_regularizer_weight=0.4)
    return dict(  # "thresholds": rows at or below the median active count are left out of FLOPS
        query_regularizer_weight=0.4,
        document_regularizer_threshold=threshold,
        query_regularizer_threshold=threshold,
    )


def both(model, feats, setting: str, directions=("query_to_doc",), **cembed_kwargs):
    """(stock CachedSpladeLoss, cembed's loss) on the same settings; large regularizer weights, so the
    FLOPS terms weigh in the gradients."""
    kwargs = regularizer_kwargs(setting, median_active(model, feats)) | dict(
        document_regularizer_weight=0.3, mini_batch_size=MINI
    )
    stock = CachedSpladeLoss(model, SparseMultipleNegativesRankingLoss(model, directions=directions), **kwargs)
    ours = SparseCachedSpladeLoss(
        model, SparseMultipleNegativesRankingLoss(model, directions=directions), **kwargs, **cembed_kwargs
    )
    return stock, ours


def assert_matches(loss, grads, ref_loss, ref_grads, tol: float) -> None:
    """The loss and every parameter's gradient within ``tol`` relative: ``||g - ref|| <= tol * ||ref||``.
    A gradient that is zero in exact arithmetic (attention's key bias: softmax is shift-invariant) is
    float noise of about 1e-12 in both; its norm is floored at 1e-6 of the whole gradient's norm."""
    assert rel_diff(loss, ref_loss) <= tol, (loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    floor = 1e-6 * torch.linalg.vector_norm(torch.cat([g.flatten() for g in ref_grads.values()]))
    worst = {
        name: (torch.linalg.vector_norm(grads[name] - ref) / max(torch.linalg.vector_norm(ref), floor)).item()
        for name, ref in ref_grads.items()
    }
    assert max(worst.values()) <= tol, max(worst.items(), key=lambda kv: kv[1])


FAST_CASES = {("triplets", "relu", "thresholds"), ("pairs", "log1p_relu", "documents_and_queries")}
STOCK_CASES = [
    pytest.param(
        columns,
        activation,
        setting,
        id=f"{name}-{activation}-{setting}",
        marks=() if (name, activation, setting) in FAST_CASES else pytest.mark.slow,
    )
    for name, columns in (("pairs", PAIRS), ("triplets", TRIPLETS))
    for activation in ("relu", "log1p_relu")
    for setting in ("documents", "documents_and_queries", "thresholds")
]


@pytest.mark.parametrize(("columns", "activation", "setting"), STOCK_CASES)
def test_equals_stock_cached_splade(models, columns, activation, setting):
    model = models[activation]
    model.train()
    feats = features(model, columns)
    stock, ours = both(model, feats, setting)
    ref_loss, ref_grads = step(model, stock, feats)
    loss, grads = step(model, ours, feats)
    assert_matches(loss, grads, ref_loss, ref_grads, 1e-5)
    assert ours._component_values.keys() == stock._component_values.keys()
    for key, value in stock._component_values.items():
        assert ours._component_values[key] == pytest.approx(value, rel=1e-5), key
    counts = ours.sparse_counts
    assert counts.sparse_minibatches > 0 and counts.dense_minibatches > 0  # both forms in one column
    if setting == "thresholds":  # the threshold left rows out: FLOPS differs from the unthresholded one
        plain = SparseCachedSpladeLoss(
            model, SparseMultipleNegativesRankingLoss(model), document_regularizer_weight=0.3, mini_batch_size=MINI
        )
        plain(feats, None)
        assert plain._component_values["document_regularizer_loss"] != pytest.approx(
            ours._component_values["document_regularizer_loss"], rel=1e-3
        )


@pytest.mark.parametrize(
    "directions", [ALL_DIRECTIONS, pytest.param(("query_to_doc", "doc_to_query"), marks=pytest.mark.slow)]
)
def test_equals_stock_with_more_directions(models, directions):
    model = models["relu"]
    model.train()
    feats = features(model, TRIPLETS)
    stock, ours = both(model, feats, "documents_and_queries", directions)
    ref_loss, ref_grads = step(model, stock, feats)
    loss, grads = step(model, ours, feats)
    assert_matches(loss, grads, ref_loss, ref_grads, 1e-5)


def test_a_cache_that_drops_the_last_active_index_is_caught(models, monkeypatch):
    """A broken copy: the cached gradient loses each row's last active coordinate. The loss still agrees,
    the gradient check above fails."""
    model = models["relu"]
    model.train()
    feats = features(model, PAIRS)
    stock, ours = both(model, feats, "documents_and_queries", cache_form="sparse")
    ref_loss, ref_grads = step(model, stock, feats)
    real = cached_splade.MiniBatchGrads.__getitem__

    def dropping(self, index):
        begin, end = self.ranges[index]
        part = self.grad.slice(begin, end)
        values = part.values.clone()
        ends = part.crow[1:].to(torch.int64)
        values[ends[ends > part.crow[:-1].to(torch.int64)] - 1] = 0  # each non-empty row's last coordinate
        return part.with_values(values).to_dense()

    monkeypatch.setattr(cached_splade.MiniBatchGrads, "__getitem__", dropping)
    loss, grads = step(model, ours, feats)
    assert rel_diff(loss, ref_loss) <= 1e-6
    with pytest.raises(AssertionError):
        assert_matches(loss, grads, ref_loss, ref_grads, 1e-5)
    monkeypatch.setattr(cached_splade.MiniBatchGrads, "__getitem__", real)
    assert_matches(*step(model, ours, feats), ref_loss, ref_grads, 1e-5)


# MLM biases of a 1,000-wide tiny SPLADE and the row densities they give (measured: min, max).
DENSITIES = {-0.35: (0.005, 0.015), -0.25: (0.04, 0.13), 0.0: (0.85, 0.99), 0.3: (1.0, 1.0)}


@pytest.mark.parametrize(
    "bias", [b if b in (-0.35, 0.3) else pytest.param(b, marks=pytest.mark.slow) for b in DENSITIES]
)
def test_sparse_cache_equals_dense_cache(tmp_path, bias):
    """Exactness of the sparse cache: the model's gradients with each row's gradient kept at its active
    coordinates only equal those with the whole dense gradient kept, at densities from 1 % to 100 %.
    In float64, so that what is compared is the cache, not float32's summation order (the CSR and the
    dense kernels add in different orders: up to 6e-6 relative apart in float32 at 100 % density)."""
    model = make_tiny_splade(tmp_path, width=1000, bias=bias).double()
    model.train()
    feats = features(model, TRIPLETS)
    with torch.no_grad():
        density = torch.cat([(model(f)["sentence_embedding"] != 0).float().mean(dim=1) for f in feats])
    low, high = DENSITIES[bias]
    assert low <= density.min() and density.max() <= high, (density.min(), density.max())

    def run(form):
        loss = SparseCachedSpladeLoss(
            model,
            SparseMultipleNegativesRankingLoss(model),
            document_regularizer_weight=0.3,
            query_regularizer_weight=0.4,
            mini_batch_size=MINI,
            cache_form=form,
        )
        return (*step(model, loss, feats), loss.sparse_counts)

    dense_loss, dense_grads, dense_counts = run("dense")
    sparse_loss, sparse_grads, sparse_counts = run("sparse")
    assert dense_counts.sparse_minibatches == 0 and sparse_counts.dense_minibatches == 0
    assert_matches(sparse_loss, sparse_grads, dense_loss, dense_grads, 1e-9)
    assert dense_counts.stored_bytes == 3 * len(TEXTS["anchor"]) * 1000 * 8
    if density.max() < 0.1:
        assert sparse_counts.stored_bytes < dense_counts.stored_bytes / 4


def test_counts_say_what_the_cache_held(tmp_path):
    """Active coordinates per column are the rows' own; rows too dense for the sparse form fall back to
    the dense form per mini-batch, and the counters say so."""
    sparse_model = make_tiny_splade(tmp_path / "sparse", width=1000, bias=-0.25)
    dense_model = make_tiny_splade(tmp_path / "dense", width=1000, bias=0.3)
    for model, dense_expected in ((sparse_model, False), (dense_model, True)):
        feats = features(model, PAIRS)
        loss = SparseCachedSpladeLoss(
            model, SparseMultipleNegativesRankingLoss(model), document_regularizer_weight=0.3, mini_batch_size=MINI
        )
        with torch.no_grad():
            loss(feats, None)
            active = [int((model(f)["sentence_embedding"] != 0).sum()) for f in feats]
        counts = loss.sparse_counts
        n = len(TEXTS["anchor"])
        assert [counts.mean_active(k) for k in (0, 1)] == [a / n for a in active]
        assert (counts.dense_minibatches, counts.sparse_minibatches) == ((6, 0) if dense_expected else (0, 6))
        assert counts.dense_share() == float(dense_expected)
        if dense_expected:
            assert counts.bytes_per_row() == 1000 * 4
        else:  # values (4 B) + int32 column indices (4 B) per active coordinate, + row offsets
            assert counts.bytes_per_row() == (8 * sum(active) + 4 * (2 * n + 6)) / (2 * n)
        counts.reset()
        assert counts.bytes_per_row() is None and counts.dense_share() is None


def test_regularizer_warmup_callback_drives_the_weights(models):
    """sentence-transformers' SpladeRegularizerWeightSchedulerCallback (the λ warm-up) accepts the loss
    and the loss reads the weights it sets: at a quarter of the warm-up (quadratic) the FLOPS terms
    weigh 1/16 of their full weights."""
    model = models["relu"]
    feats = features(model, PAIRS)
    loss = SparseCachedSpladeLoss(
        model,
        SparseMultipleNegativesRankingLoss(model),
        document_regularizer_weight=0.3,
        query_regularizer_weight=0.4,
        mini_batch_size=MINI,
    )
    with torch.no_grad():
        loss(feats, None)
    full = dict(loss._component_values)
    callback = SpladeRegularizerWeightSchedulerCallback(loss, scheduler_type="quadratic", warmup_ratio=0.5)
    state, control = TrainerState(max_steps=16), TrainerControl()
    callback.on_train_begin(None, state, control)
    with torch.no_grad():
        loss(feats, None)
    assert loss._component_values["document_regularizer_loss"] == 0.0
    state.global_step = 2  # warm-up of 8 steps: ratio 1/4
    callback.on_step_begin(None, state, control)
    with torch.no_grad():
        loss(feats, None)
    for key in ("document_regularizer_loss", "query_regularizer_loss"):
        assert loss._component_values[key] == pytest.approx(full[key] / 16, rel=1e-6)


def test_refuses_what_it_does_not_compute(models):
    model = models["relu"]
    with pytest.raises(ValueError, match="dot product"):
        SparseCachedSpladeLoss(
            model, SparseMultipleNegativesRankingLoss(model, similarity_fct=cos_sim), document_regularizer_weight=1
        )

    class OtherRegularizer(FlopsLoss):
        pass

    with pytest.raises(ValueError, match="FlopsLoss only, got OtherRegularizer"):
        SparseCachedSpladeLoss(
            model,
            SparseMultipleNegativesRankingLoss(model),
            document_regularizer_weight=1,
            query_regularizer_weight=1,
            query_regularizer=OtherRegularizer(model),
        )
    with pytest.raises(ValueError, match="cache_form"):
        SparseCachedSpladeLoss(
            model, SparseMultipleNegativesRankingLoss(model), document_regularizer_weight=1, cache_form="csr"
        )
    config = SparseCachedSpladeLoss(
        model, SparseMultipleNegativesRankingLoss(model), document_regularizer_weight=1, mini_batch_size=5
    ).get_config_dict()
    assert (config["mini_batch_size"], config["document_regularizer_weight"], config["cache_form"]) == (5, 1, "auto")


def test_calculate_loss_on_dense_reps_matches_stock(models):
    """The CachedLossMixin contract on dense mini-batch embeddings (what the probe hands a cached loss):
    the same loss as stock, and each rep's ``.grad`` equal to stock's at the rep's non-zero coordinates
    (zero elsewhere, where no gradient reaches the model)."""
    model = models["relu"]
    feats = features(model, TRIPLETS)
    stock, ours = both(model, feats, "documents_and_queries", cache_form="sparse")
    with torch.no_grad():
        reps = [[model(f)["sentence_embedding"][i : i + MINI] for i in range(0, 7, MINI)] for f in feats]

    def leaves():
        return [[r.clone().requires_grad_() for r in col] for col in reps]

    ref, mine = leaves(), leaves()
    ref_loss = stock.calculate_loss(ref, with_backward=True)
    loss = ours.calculate_loss(mine, with_backward=True)
    assert rel_diff(loss, ref_loss) <= 1e-5
    for ref_col, col in zip(ref, mine):
        for r, m in zip(ref_col, col):
            active = r.detach() != 0
            assert rel_diff(m.grad[active], r.grad[active]) <= 1e-5
            assert m.grad[~active].abs().sum() == 0


def test_sparse_rows_round_trip_and_scores():
    """SparseRows keeps exactly the non-zero coordinates; its CSR scores and their gradients (the chunk's,
    and the stored values' only) equal a dense matmul's."""
    torch.manual_seed(0)
    x = torch.randn(6, 50).relu() * (torch.rand(6, 50) < 0.2)
    x[2] = 0  # an empty row
    rows = SparseRows.from_dense(x, "sparse")
    assert rows.is_sparse and rows.values.numel() == int((x != 0).sum()) and rows.col.dtype == torch.int32
    assert torch.equal(rows.to_dense(), x) and torch.equal(rows.slice(1, 4).to_dense(), x[1:4])
    assert SparseRows.from_dense(x).is_sparse and not SparseRows.from_dense(torch.rand(6, 50) + 0.1).is_sparse

    chunk = torch.randn(4, 50, requires_grad=True)
    values = rows.values.clone().requires_grad_()
    upstream = torch.randn(4, 6)
    (rows.with_values(values).scores(chunk) * upstream).sum().backward()
    dense = x.clone().requires_grad_()
    chunk_ref = chunk.detach().clone().requires_grad_()
    (chunk_ref @ dense.t() * upstream).sum().backward()
    assert torch.allclose(chunk.grad, chunk_ref.grad, atol=1e-6)
    assert torch.allclose(values.grad, dense.grad[x != 0], atol=1e-6)
