"""No-duplicates sampler: no text twice in a batch across columns; exact batch counts."""

from __future__ import annotations

import numpy as np
import pytest
from datasets import Dataset

from cembed.data.batching.full_table import NoDuplicatesSampler, build_batches


def _texts(ds, batch):
    return [t for i in batch for t in ds[i].values()]


def test_cross_column_duplicate_never_shares_a_batch():
    # Row i's positive is row i+1's anchor: a text is the anchor of one row and the positive of another.
    n = 40
    ds = Dataset.from_dict({"anchor": [f"t{i}" for i in range(n)], "positive": [f"t{i + 1}" for i in range(n)]})
    for seed in range(5):
        sampler = NoDuplicatesSampler(ds, batch_size=8, drop_last=False, seed=seed)
        batches = list(sampler)
        assert len(batches) == len(sampler)
        placed = sorted(i for b in batches for i in b)
        assert len(set(placed)) == len(placed) == n - sampler.unplaced  # each row at most once
        assert sampler.unplaced < 8 and all(len(b) == 8 for b in batches[:-1])  # less than a batch left out
        for b in batches:
            texts = _texts(ds, b)
            assert len(texts) == len(set(texts))


def test_duplicate_heavy_exact_counts_both_drop_last_settings():
    # 30 rows, anchors from 6 topics x 5 rows each: at most one row per topic in a batch, so a
    # batch of 6 needs every topic once -> exactly 5 full batches; with batch 4, 7 full batches
    # (28 rows), 2 rows left for a final partial batch.
    anchors = [f"topic {i % 6}" for i in range(30)]
    ds = Dataset.from_dict({"anchor": anchors, "positive": [f"p{i}" for i in range(30)]})
    for drop_last, bs, expected in [(True, 6, 5), (False, 6, 5), (True, 4, 7), (False, 4, 8)]:
        sampler = NoDuplicatesSampler(ds, batch_size=bs, drop_last=drop_last, seed=1)
        batches = list(sampler)
        assert len(sampler) == len(batches) == expected, (drop_last, bs)
        for b in batches:
            assert len({ds[i]["anchor"] for i in b}) == len(b)
        if not drop_last:
            assert sorted(i for b in batches for i in b) == list(range(30))
        else:
            assert all(len(b) == bs for b in batches)
            assert sampler.unplaced == 30 - bs * expected


def test_same_seed_same_batches_new_epoch_new_batches():
    ds = Dataset.from_dict({"anchor": [f"a{i}" for i in range(64)], "positive": [f"b{i}" for i in range(64)]})
    s1 = NoDuplicatesSampler(ds, batch_size=8, drop_last=True, seed=3)
    s2 = NoDuplicatesSampler(ds, batch_size=8, drop_last=True, seed=3)
    assert list(s1) == list(s2)
    first = list(s1)
    s1.set_epoch(1)
    assert list(s1) != first and len(s1) == 8


def test_impossible_data_yields_no_batch():
    h = np.array([[1, 2], [1, 3], [1, 4]], dtype=np.uint64)  # every row shares text 1
    batches, unplaced = build_batches(h, batch_size=2, drop_last=True, seed=0)
    assert batches == [] and unplaced == 3
    # drop_last false: no 1-row batch (it has no in-batch negative and trains at loss 0); the rows go unused.
    batches, unplaced = build_batches(h, batch_size=2, drop_last=False, seed=0)
    assert batches == [] and unplaced == 3


def test_refused_candidate_does_not_block_a_later_one():
    # Issue 12 case 7: row 1 shares "a" with row 0 and is refused; row 2 shares "c" only with the
    # refused row 1, so a row-by-row first fit takes it (the sampler used to refuse it too).
    from cembed.data.batching.fits import fits

    h = np.array([[1, 2], [1, 3], [3, 4], [5, 6]], dtype=np.uint64)  # (a,b) (a,c) (c,d) (e,f)
    empty = np.empty(0, dtype=np.uint64)
    assert fits(h, np.arange(4), empty, 4).tolist() == [True, False, True, True]
    assert fits(h, np.arange(4), empty, 2).tolist() == [True, False, True, False]  # full after 2
    assert fits(h, np.arange(4), np.array([2], dtype=np.uint64), 4).tolist() == [False, True, False, True]


@pytest.mark.parametrize("drop_last", [True, False])
def test_build_batches_equals_the_row_by_row_first_fit(drop_last):
    # Batches (hence batches per epoch and unused rows) equal the exact first fit's, on small
    # duplicate-heavy tables, at every batch size, long chains included.
    from cembed.data.batching.full_table import build_batches_row_by_row

    rng = np.random.default_rng(12)
    tables = [rng.integers(0, int(rng.integers(2, 60)), size=(int(rng.integers(1, 50)), 3)) for _ in range(60)]
    tables.append(np.stack([np.arange(300), (np.arange(300) + 1) % 300], axis=1))  # t_i -> t_{i+1}, a cycle
    for seed, table in enumerate(tables):
        h = table.astype(np.uint64)
        for bs in (1, 2, 3, 7, 64):
            fast = build_batches(h, bs, drop_last, seed)
            assert fast == build_batches_row_by_row(h, bs, drop_last, seed), (seed, bs)
            batches, unplaced = fast
            assert sum(len(b) for b in batches) + unplaced == len(h)


def test_no_one_row_batches_without_drop_last():
    # Issue 12 case 7: rows t0->t1, t1->t2, t2->t3, t3->t0 at batch 4, seed 1: rows 0 and 2 (and 1
    # and 3) share no text; the sampler used to yield 1-row batches (loss 0). One short last batch
    # of 2 is kept (issue 23: a second short batch would train below the plan's batch); 2 rows unused.
    ds = Dataset.from_dict({"anchor": [f"t{i}" for i in range(4)], "positive": [f"t{(i + 1) % 4}" for i in range(4)]})
    sampler = NoDuplicatesSampler(ds, batch_size=4, drop_last=False, seed=1)
    batches = list(sampler)
    assert [sorted(b) for b in batches] in ([[0, 2]], [[1, 3]]) and len(sampler) == 1 and sampler.unplaced == 2


@pytest.mark.slow
@pytest.mark.parametrize("accum", [1, 2])
def test_optimizer_steps_equal_sampler_batches(tiny_model_dir, tmp_path, accum):
    """Through the real trainer: the steps it runs in one epoch equal the batches the sampler yields."""
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    anchors = [f"topic {i % 9}" for i in range(45)]  # 9 distinct anchors, 5 rows each
    ds = Dataset.from_dict({"anchor": anchors, "positive": [f"answer {i}" for i in range(45)]})
    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=accum,
        num_train_epochs=1,
        batch_sampler=NoDuplicatesSampler,
        dataloader_drop_last=True,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        use_cpu=True,
        seed=7,
    )
    trainer = SentenceTransformerTrainer(
        model=model, args=args, train_dataset=ds, loss=MultipleNegativesRankingLoss(model)
    )
    sampler = trainer.get_train_dataloader().batch_sampler
    n_batches = len(list(sampler))
    assert n_batches == len(sampler) == 11  # 45 rows -> 11 full batches of 4, 1 row left
    trainer.train()
    assert trainer.state.global_step == -(-n_batches // accum)


def test_inspect_batches_counts():
    from cembed.data.identity import row_hashes
    from cembed.data.inspect import colliding_rows, inspect_batches

    ds = Dataset.from_dict(
        {
            "anchor": ["a", "b", "c", "d", "e", "f"],
            "positive": ["x", "a", "y", "z", "e", "w"],  # row1 positive == row0 anchor; row4 anchor == positive
        }
    )
    h = row_hashes(ds, ["anchor", "positive"])
    assert colliding_rows(h).tolist() == [True, True, False, False, False, False]
    for seed in range(6):
        report = inspect_batches(h, batch_size=2, drop_last=True, seed=seed)
        assert report["colliding_share"] == pytest.approx(2 / 6)
        assert report["largest_batch"] == 5 and report["largest_batch_upper_bound"] == 6
        # Greedy: 3 batches unless the colliding rows 0 and 1 are the last two left.
        assert report["batches_per_epoch"] in (2, 3)
        assert report["rows_unplaced"] == 6 - 2 * report["batches_per_epoch"]
        assert report["batches_per_epoch"] == len(NoDuplicatesSampler(ds, batch_size=2, drop_last=True, seed=seed))


def test_inspect_data_cli(write_config, pairs_file):
    from typer.testing import CliRunner

    from cembed.cli.app import app

    rows = [{"anchor": f"topic {i % 5}", "positive": f"p{i}"} for i in range(20)]
    path = write_config(
        {"data": {"train": str(pairs_file(rows))}, "batch": {"per_device_train_batch_size": 4, "mini_batch_size": 2}}
    )
    r = CliRunner().invoke(app, ["inspect-data", str(path)])
    assert r.exit_code == 0, r.output
    assert "distinct texts: anchor (anchor)" in r.output and "│ 5 " in r.output
    assert "100.00%" in r.output  # every anchor repeats
    assert "5 found (at most 5)" in r.output


def test_duplicates_compared_as_the_model_sees_them(tiny_model_dir, tmp_path):
    # Issue 12 case 4: three spellings of one caption are one text to an uncased tokenizer.
    from sentence_transformers import SentenceTransformer

    from cembed.data.identity import row_hashes
    from cembed.data.tokens.tokenize import pretokenize

    same = ["A red car on the street.", "a red car on the street. ", "A RED CAR ON THE STREET."]
    positives = same + [f"{w} dog" for w in "abcde"]
    ds = Dataset.from_dict({"anchor": [f"question {i}" for i in range(8)], "positive": positives})
    assert len(set(row_hashes(ds, ["positive"])[:3, 0])) == 3  # raw text: three different texts
    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    tokenized = pretokenize(ds, ["anchor", "positive"], model.tokenizer, 64, tmp_path).dataset
    assert len(set(row_hashes(tokenized, ["positive"])[:3, 0])) == 1  # token ids: one text
    for seed in range(4):
        sampler = NoDuplicatesSampler(tokenized, batch_size=3, drop_last=True, seed=seed)
        for batch in sampler:
            assert sum(i < 3 for i in batch) <= 1, batch


def test_sampler_hashes_only_text_columns():
    # No text column (a numeric column and a label column of equal values): nothing to compare, all batches built.
    ds = Dataset.from_dict({"x": [1.0] * 8, "label": [1] * 8})
    sampler = NoDuplicatesSampler(ds, batch_size=2, drop_last=True, valid_label_columns=["label"])
    assert len(sampler) == 4 and sorted(i for b in sampler for i in b) == list(range(8))


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_no_repair_shrinks_a_full_batch(seed):
    # Issue 23 item 14: 64 rows, half of them sharing one hard negative, batch 16, drop_last false.
    # A batch holds one popular row, so two full batches (1 popular + 15 others each) and a short
    # last batch (1 popular + the 2 others left) are all that exist; the 29 other popular rows go
    # unused (and are reported). The lone-row repair used to pull partners out of the full batches
    # until the epoch was 32 batches of 2 while the run said "batch 16".
    from cembed.data.batching.full_table import build_batches_row_by_row

    negatives = ["a popular hard negative" if i % 2 else f"negative {i}" for i in range(64)]
    ds = Dataset.from_dict(
        {
            "anchor": [f"query {i}" for i in range(64)],
            "positive": [f"doc {i}" for i in range(64)],
            "negative": negatives,
        }
    )
    sampler = NoDuplicatesSampler(ds, batch_size=16, drop_last=False, seed=seed)
    batches = list(sampler)
    assert [len(b) for b in batches] == [16, 16, 3] and len(sampler) == 3 and sampler.unplaced == 29
    assert build_batches_row_by_row(sampler.hashes, 16, False, seed) == (sampler.global_batches(), 29)


@pytest.mark.parametrize("drop_last", [True, False])
def test_every_batch_but_the_last_is_full(drop_last):
    # Whatever the duplicates, only the epoch's last batch may be short (and never a single row).
    rng = np.random.default_rng(5)
    for seed in range(40):
        h = rng.integers(0, int(rng.integers(3, 40)), size=(int(rng.integers(2, 80)), 3)).astype(np.uint64)
        for bs in (2, 3, 8):
            batches, unplaced = build_batches(h, bs, drop_last, seed)
            assert all(len(b) == bs for b in batches[:-1]), (seed, bs, [len(b) for b in batches])
            assert all(len(b) >= 2 for b in batches) and sum(map(len, batches)) + unplaced == len(h)


def _dense_rows(anchors: int, positives: int, rows: int = 48) -> Dataset:
    import random

    pick = random.Random(0)
    pairs = [(f"topic {pick.randrange(anchors)}", f"answer {pick.randrange(positives)}") for _ in range(rows)]
    return Dataset.from_dict({"anchor": [a for a, _ in pairs], "positive": [p for _, p in pairs]})


@pytest.mark.parametrize(("anchors", "positives", "seed"), [(12, 30, 2), (14, 40, 0), (10, 60, 3)])
def test_every_epoch_has_the_first_epochs_number_of_batches(anchors, positives, seed):
    """sentence-transformers#3348 (its NoDuplicatesBatchSampler's length above what a pass yields;
    fixed by #3946's resampling): duplicate-heavy data leaves a shuffle-dependent number of rows over,
    so a first fit gives some epochs a batch more or less than the first (12 anchors x 30 positives,
    seed 2: 5, 5, 4, 5, 5 batches of 8; 14 x 40, seed 0: 4, 5, 5, 5). transformers plans every epoch
    with the first epoch's length: a shorter epoch ended the run short of train.max_steps (15 steps
    asked, 14 trained, "completed") and misplaced a resume after it; a longer one lost its last batch
    while the summary counted it. Every epoch now yields the first epoch's count, each batch
    duplicate-free; the reference is the plain first fit of each epoch's shuffle."""
    from cembed.data.batching.full_table import build_batches_flat
    from cembed.data.identity import row_hashes

    ds = _dense_rows(anchors, positives)
    sampler = NoDuplicatesSampler(ds, batch_size=8, drop_last=True, seed=seed)
    hashes = row_hashes(ds, sampler.columns)
    first_fit = [len(build_batches_flat(hashes, 8, True, seed + epoch)[1]) - 1 for epoch in range(5)]
    assert len(set(first_fit)) > 1, first_fit  # the data does make epochs of different lengths
    target = first_fit[0]
    for epoch in range(5):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler) == target, (epoch, first_fit)
        assert all(len(b) == 8 for b in batches)
        for b in batches:
            texts = _texts(ds, b)
            assert len(texts) == len(set(texts))
        assert sampler.unplaced == 48 - len({i for b in batches for i in b})
        if first_fit[epoch] >= target:  # an epoch long enough is its own first fit's first batches
            plain, bounds, _ = build_batches_flat(hashes, 8, True, seed + epoch)
            assert batches == [plain[a:b].tolist() for a, b in zip(bounds[:target], bounds[1 : target + 1])]
    assert sampler.rows_trained(5 * target) == 5 * target * 8  # the counts follow what trains
