"""Token-budget mini-batches (batch.mini_batch_num_tokens): ranges by rows x padded width, the
result independent of them, and the probe's budget from the longest-rows worst case."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import distinct_pairs, loss_and_grads, rel_diff
from sentence_transformers import SentenceTransformer
from typer.testing import CliRunner

from cembed.cli.app import app
from cembed.config.file import config_from_dict, load_config
from cembed.config.loss import loss_config
from cembed.config.schema import ModelConfig
from cembed.losses.length_sorted import minibatch_ranges
from cembed.losses.registry import build_loss
from cembed.losses.token_budget import padded_ranges, row_extents, token_budget_ranges
from cembed.plan.resolve import resolve_plan
from cembed.probe.auto import override_line
from cembed.probe.search import probe_token_budget, run_trial, search_mini_batch
from cembed.probe.trials import SubprocessTrial, TrialOutcome, TrialSpec

# Lengths (in words) from long to short with a gap: the case where counting non-padding tokens
# would pad many short rows to a long row's width.
WORDS = [40, 38, 37, 30, 12, 11, 10, 9, 6, 5, 5, 4, 3, 3, 2, 2, 1, 1, 1, 1]


def _texts(lengths, offset=0):
    vocab = "man woman dog cat train table street car room plate food bus".split()
    return [" ".join(vocab[(i + j + offset) % len(vocab)] for j in range(n)) for i, n in enumerate(lengths)]


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
    library = minibatch_ranges(feature, 4, 90)  # counts non-padding tokens
    assert max((e - b) * max(lengths[b:e]) for b, e in library) > 90  # e.g. the 32-token row + short ones


@pytest.mark.slow
@pytest.mark.parametrize(("budget", "sort"), [(1, True), (45, True), (90, False), (10_000, True)])
def test_budget_gives_the_same_loss_and_gradients(tiny_model_dir, budget, sort):
    """fp32: the loss and gradients with a token budget equal the plain (one-pass) loss's and the
    row-cut cached loss's to 1e-5 relative, whatever the budget."""
    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    model.train()
    features = [model.tokenize(_texts(WORDS)), model.tokenize(_texts(list(reversed(WORDS)), offset=3))]
    ref_loss, ref_grads = loss_and_grads(model, build_loss(model, loss_config(name="mnrl"), 1).module, features)
    rows_loss, rows_grads = loss_and_grads(model, build_loss(model, loss_config(), 4).module, features)
    built = build_loss(model, loss_config(), 4, mini_batch_num_tokens=budget, sort_by_length=sort)
    loss, grads = loss_and_grads(model, built.module, features)
    assert rel_diff(loss, ref_loss) <= 1e-5 and rel_diff(grads, ref_grads) <= 1e-5
    assert rel_diff(loss, rows_loss) <= 1e-5 and rel_diff(grads, rows_grads) <= 1e-5
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


# ----------------------------------------------------------------------------------------------
# The probe: the token budget from the longest-rows worst case


WIDTH = 16  # tokens per row in the fake trials
PER_ROW = 1000  # fake bytes per row: 37 rows = 37000 <= 0.9 x 41200 = 37080 fits, 38 rows do not


def fake_trial(calls):
    """Peak = PER_ROW x rows; a token trial cuts budget // WIDTH rows (the full-length worst case)."""

    def trial(size, num_tokens=None):
        calls.append((size, num_tokens))
        rows = max(1, num_tokens // WIDTH) if num_tokens is not None else size
        return TrialOutcome(peak_bytes=PER_ROW * rows, samples_per_s=10.0 * rows, rows=rows, tokens_per_row=WIDTH)

    return trial


def test_probe_token_budget_from_the_row_search():
    calls = []
    trial = fake_trial(calls)
    result = search_mini_batch(trial, 41200, margin=0.10, cap=1024, knee_fraction=None)
    assert result.recommended == result.max_fit == 37
    probe_token_budget(result, trial)
    assert calls[-1] == (37, 37 * WIDTH)  # the budget itself was run
    assert result.tokens_per_row == WIDTH
    assert result.recommended_num_tokens == 37 * WIDTH == 592 and result.max_fit_num_tokens == 592
    last = result.trials[-1]
    assert (last.size, last.num_tokens, last.fits, last.peak_bytes) == (37, 592, True, 37000)
    # the next budget that changes the mini-batch (one more row) does not fit
    over = run_trial(trial, 37, result.limit_bytes, num_tokens=592 + WIDTH)
    assert over.size == 38 and not over.fits
    assert override_line(result) == "batch.mini_batch_size=37 batch.mini_batch_num_tokens=592"


def test_probe_token_budget_knee_and_failure():
    calls = []
    trial = fake_trial(calls)
    result = search_mini_batch(trial, 41200, margin=0.10, cap=1024, knee_fraction=0.95)
    result.recommended = 16  # as the knee rule would pick: the budget follows the recommendation
    probe_token_budget(result, trial)
    assert result.recommended_num_tokens == 256 and result.max_fit_num_tokens == 37 * WIDTH

    def failing(size, num_tokens=None):
        if num_tokens is not None:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return TrialOutcome(peak_bytes=PER_ROW * size, samples_per_s=1.0, rows=size, tokens_per_row=WIDTH)

    result = search_mini_batch(failing, 41200, margin=0.10, cap=1024, knee_fraction=None)
    probe_token_budget(result, failing)
    assert result.recommended_num_tokens is None and result.max_fit_num_tokens is None
    assert result.notes == [
        "no token budget: the trial at 592 tokens did not fit (RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB)"
    ]
    assert override_line(result) == "batch.mini_batch_size=37"


@pytest.mark.slow
def test_cpu_token_budget_fits_and_a_larger_one_does_not(tiny_model_dir):
    """Real trials on CPU (child processes, resident memory): with a memory budget between the
    peaks of 64 and 128 full-length rows, the probe's budget (64 rows x 128 tokens) is run and fits;
    the budget of 128 rows' tokens cuts 128 rows and does not."""
    spec = TrialSpec(
        model=ModelConfig(name_or_path=str(tiny_model_dir), max_seq_length=128, device="cpu").model_dump(),
        loss=loss_config().model_dump(),
        n_columns=2,
        batch_size=256,
        device="cpu",
    )
    trial = SubprocessTrial(spec)
    small, large = trial(64), trial(128)
    assert small.tokens_per_row == large.tokens_per_row == 128 and (small.rows, large.rows) == (64, 128)
    budget = (small.peak_bytes + large.peak_bytes) // 2
    trial.kill_above = budget
    result = search_mini_batch(trial, budget, margin=0.0, cap=64, start=64, knee_fraction=None)
    probe_token_budget(result, trial)
    assert result.recommended_num_tokens == result.max_fit_num_tokens == 64 * 128
    at = result.trials[-1]
    assert (at.num_tokens, at.size, at.fits) == (64 * 128, 64, True) and at.peak_bytes <= budget
    over = run_trial(trial, 64, budget, num_tokens=128 * 128)
    assert over.size == 128 and not over.fits and over.peak_bytes > budget


class FakeTrials:
    """Stands in for SubprocessTrial in run_probe: fake_trial's device, calls recorded."""

    calls: list = []

    def __init__(self, spec, kill_above_bytes=None):
        self.trial = fake_trial(FakeTrials.calls)

    def __call__(self, size, num_tokens=None):
        return self.trial(size, num_tokens)


def test_auto_sets_both_and_keeps_a_user_budget(monkeypatch, tiny_model_dir):
    import cembed.probe.auto as probe
    from cembed.plan.resolve import Plan

    monkeypatch.setattr(probe, "SubprocessTrial", FakeTrials)
    FakeTrials.calls = []
    cfg = ModelConfig(name_or_path=str(tiny_model_dir), max_seq_length=16, device="cpu")
    plan = Plan("cpu", 1, 64, 1, 64, 1e-5, "", "fp32")
    resolved, result = probe.resolve_auto(plan, cfg, loss_config(), 2, "41200", margin=0.10)
    assert result.max_fit == 37  # 37 x 1000 <= 0.9 x 41200
    assert resolved.mini_batch_size == result.recommended
    assert resolved.mini_batch_num_tokens == result.recommended * WIDTH == result.recommended_num_tokens
    assert resolved.mini_batch_probe["override"] == (
        f"batch.mini_batch_size={result.recommended} batch.mini_batch_num_tokens={result.recommended * WIDTH}"
    )
    # a budget the config sets is kept, and no token trial runs
    FakeTrials.calls = []
    resolved, result = probe.resolve_auto(replace(plan, mini_batch_num_tokens=500), cfg, loss_config(), 2, "41200")
    assert resolved.mini_batch_num_tokens == 500 and resolved.mini_batch_size == result.recommended
    assert all(tokens is None for _, tokens in FakeTrials.calls)
    # mini_batch_size alone (no auto): nothing probed, no budget
    plan = resolve_plan(config_from_dict({"data": {"train": "x.jsonl"}, "batch": {"mini_batch_size": 8}}))
    assert plan.mini_batch_size == 8 and plan.mini_batch_num_tokens is None
    assert probe.resolve_auto(plan, cfg, loss_config(), 2)[1] is None


def test_write_stores_both(monkeypatch, tiny_model_dir, write_config, pairs_file):
    import cembed.probe.auto as probe

    monkeypatch.setattr(probe, "SubprocessTrial", FakeTrials)
    cfg = write_config(
        {
            "model": {"name_or_path": str(tiny_model_dir), "max_seq_length": 16, "device": "cpu"},
            "data": {"train": str(pairs_file(distinct_pairs(64)))},
            "batch": {"per_device_train_batch_size": 64, "mini_batch_size": "auto"},
        }
    )
    r = CliRunner().invoke(app, ["probe-minibatch", str(cfg), "--max-memory", "41200", "--write"])
    assert r.exit_code == 0, r.output
    batch = load_config(cfg).batch
    assert batch.mini_batch_size == 36  # the knee: 36 rows reach >= 95% of 37 rows' samples/s (10 per row)
    assert batch.mini_batch_num_tokens == 36 * WIDTH == 576
    assert (
        "recommended mini_batch_num_tokens: 576 (= 36 rows x 16 tokens; largest that fits: 592 = 37 x 16)" in r.output
    )
    assert "override: batch.mini_batch_size=36 batch.mini_batch_num_tokens=576" in r.output
