"""cembed.data.batching.placement: rows the no-duplicates sampler cannot place, counted and explained for a
tiny table with known duplicates, and ``inspect-data``'s numbers for it.

The table: 12 rows with distinct anchors; 8 of them share the positive "a popular answer", the
other 4 have their own. A duplicate-free batch of 4 holds at most one popular row, so it needs 3
of the 4 unique rows: whatever the shuffle, one batch is built and 8 rows are left out (a second
batch finds only one popular row and the last unique row to take).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from conftest import make_tiny_model
from datasets import Dataset

from cembed.config.file import config_from_dict
from cembed.config.schema import ModelConfig
from cembed.data.batching.placement import find_unplaceable, unplaceable_warnings
from cembed.data.identity import row_hashes
from cembed.data.inspect import inspect_batches, inspect_data
from cembed.data.rows import TrainingData, UnloadedData
from cembed.plan.resolve import resolve_plan

POPULAR = "a popular answer"
EXPECTED = (
    "8 of 12 rows cannot be placed in a duplicate-free batch of 4 (1 batches per epoch) and are not trained on: "
    "their texts repeat across rows, most of all column 'answer' (role positive): 'a popular answer' is in 8 rows "
    "and a batch holds it at most once; deduplicate that column, lower batch.per_device_train_batch_size or set "
    "sampler.no_duplicates: false"
)


def _data(popular=(POPULAR,) * 8) -> TrainingData:
    positives = list(popular) + [f"answer {i}" for i in range(4)]
    dataset = Dataset.from_dict({"anchor": [f"question {i}" for i in range(12)], "positive": positives})
    return TrainingData(dataset, "qa.jsonl", 12, roles={"anchor": "question", "positive": "answer"})


@pytest.mark.parametrize("seed", [0, 1, 42])
def test_unplaceable_rows_counted_and_explained(seed):
    found = find_unplaceable(_data(), batch_size=4, drop_last=True, seed=seed)
    assert (found.rows, found.total, found.batch_size, found.batches) == (8, 12, 4, 1)
    assert (found.role, found.column, found.text, found.holders) == ("positive", "answer", POPULAR, 8)
    assert str(found) == EXPECTED


def test_nothing_to_report():
    distinct = TrainingData(
        Dataset.from_dict({"anchor": [f"q{i}" for i in range(10)], "positive": [f"p{i}" for i in range(10)]}), "x", 10
    )
    # 10 rows in batches of 4: the 2 rows of the short last batch are dropped, which is not reported
    assert find_unplaceable(distinct, 4, drop_last=True, seed=0) is None
    assert find_unplaceable(distinct, 4, drop_last=False, seed=0) is None
    empty = TrainingData(Dataset.from_dict({"anchor": [], "positive": []}), "x", 0)
    assert find_unplaceable(empty, 4, drop_last=True, seed=0) is None


def test_a_lone_remainder_row_is_not_blamed_on_repeated_texts():
    # 37 distinct rows in batches of 4 without drop_last: the one row left over would be a 1-row batch,
    # which has no in-batch negative, so the sampler leaves it out; no text repeats, so nothing to report.
    distinct = TrainingData(
        Dataset.from_dict({"anchor": [f"q{i}" for i in range(37)], "positive": [f"p{i}" for i in range(37)]}), "x", 37
    )
    assert find_unplaceable(distinct, 4, drop_last=False, seed=0) is None


def test_long_text_shortened_in_the_message():
    long = "x" * 80
    found = find_unplaceable(_data((long,) * 8), 4, drop_last=True, seed=0)
    assert found.text == long
    assert f"'{'x' * 57}...' is in 8 rows" in str(found)


def test_inspect_batches_numbers():
    report = inspect_batches(row_hashes(_data().dataset), batch_size=4, drop_last=True, seed=0)
    assert report == {
        "colliding_share": pytest.approx(8 / 12),  # the 8 popular rows
        "largest_batch": 5,  # one popular row and the 4 unique ones
        "largest_batch_upper_bound": 5,  # 5 distinct positives
        "batches_per_epoch": 1,
        "rows_unplaced": 8,
    }


def test_inspect_data_report():
    (report,) = inspect_data(_data(), batch_size=4, drop_last=True, seed=3)
    assert (report.source, report.rows, report.rows_dropped, report.batch_size) == ("qa.jsonl", 12, 0, 4)
    assert report.distinct == {"anchor": ("question", 12), "positive": ("answer", 5)}
    assert report.compared_as == "raw text"
    assert (report.batching["batches_per_epoch"], report.batching["rows_unplaced"]) == (1, 8)
    assert str(report.unplaceable) == EXPECTED


def test_inspect_data_compares_token_ids_with_a_model(tmp_path):
    # cased variants of one text: 8 distinct raw texts, one text to an uncased tokenizer
    variants = [POPULAR, POPULAR.upper(), POPULAR.title(), "A popular answer", "a Popular answer"]
    variants += ["a popular Answer", "A POPULAR answer", "a popular ANSWER"]
    data = _data(variants)
    (raw,) = inspect_data(data, 4, True, 0)
    assert raw.unplaceable is None and raw.distinct["positive"] == ("answer", 12)
    assert raw.compared_as == "raw text"
    model_dir = make_tiny_model(tmp_path / "tiny")
    cfg = ModelConfig(name_or_path=str(model_dir), device="cpu")
    data_cfg = config_from_dict(
        {"data": {"train": "x.jsonl", "cache_dir": str(tmp_path / "cache")}}, base=tmp_path
    ).data
    (tokens,) = inspect_data(data, 4, True, 0, model_cfg=cfg, data_cfg=data_cfg)
    assert tokens.compared_as == f"token ids ({model_dir}, max_seq_length 64)"
    assert (tokens.batching["batches_per_epoch"], tokens.batching["rows_unplaced"]) == (1, 8)
    assert tokens.unplaceable.rows == 8 and tokens.unplaceable.holders == 8
    assert tokens.distinct["positive"] == ("answer", 5)  # the distinct counts are the sampler's too
    missing = ModelConfig(name_or_path=str(tmp_path / "no-model"), device="cpu")
    (fallback,) = inspect_data(data, 4, True, 0, model_cfg=missing)
    assert fallback.compared_as.startswith("raw text (model not loaded: ")


def test_unplaceable_warnings_beside_the_plan(tmp_path, monkeypatch):
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    cfg = config_from_dict(
        {
            "data": {"train": "x.jsonl"},
            "model": {"device": "cpu"},
            "batch": {"per_device_train_batch_size": 2, "mini_batch_size": 2},
        },
        base=tmp_path,
    )
    plan = replace(resolve_plan(cfg, world_size=2), warnings=("earlier",))  # global batch 2 x 2 = 4
    # drop_last false is forced on with two processes: the same 8 rows as above; the plan is not amended
    assert unplaceable_warnings(plan, _data(), drop_last=False, seed=5) == (EXPECTED,)
    assert plan.warnings == ("earlier",)
    assert unplaceable_warnings(plan, UnloadedData("hub/x", "offline"), drop_last=True, seed=5) == ()
    # one process, batches of 2: a popular row needs one of the 4 unique rows as its partner, so at
    # least 4 popular rows are left out; seed 0's shuffle reaches that bound (4 batches, 4 rows out)
    (warning,) = unplaceable_warnings(resolve_plan(cfg, world_size=1), _data(), drop_last=True, seed=0)
    assert warning.startswith("4 of 12 rows cannot be placed in a duplicate-free batch of 2 (4 batches per epoch)")


def test_drop_last_false_leftover_rows_reported():
    # Issue 23 item 14: 64 rows, half sharing one negative, batch 16, drop_last false: 2 full batches
    # and a short last one of 3; the 29 other popular rows are reported (no batch is shrunk for them).
    negatives = ["a popular negative" if i % 2 else f"negative {i}" for i in range(64)]
    dataset = Dataset.from_dict(
        {"anchor": [f"q {i}" for i in range(64)], "positive": [f"p {i}" for i in range(64)], "negative_1": negatives}
    )
    data = TrainingData(dataset, "t.jsonl", 64, roles={"anchor": "q", "positive": "p", "negative_1": "neg"})
    found = find_unplaceable(data, 16, drop_last=False, seed=0)
    assert (found.rows, found.batches, found.column, found.holders) == (29, 3, "neg", 32)


def test_largest_filled_batch_is_the_exact_edge_of_the_sampler():
    """The size validate and train name for a 0-batch plan: at that size the sampler builds a batch
    in epoch 0 (drop_last), one row more and it builds none (checked against build_batches itself)."""
    import numpy as np

    from cembed.data.batching.full_table import build_batches
    from cembed.data.batching.placement import largest_filled_batch

    rng = np.random.default_rng(0)
    for _ in range(100):
        n, k = int(rng.integers(1, 60)), int(rng.integers(1, 4))
        hashes = rng.integers(0, int(rng.integers(2, 40)), (n, k)).astype(np.uint64)
        seed = int(rng.integers(0, 100))
        size = largest_filled_batch(hashes, seed)
        assert len(build_batches(hashes, size, True, seed)[0]) >= 1
        assert size == n or not build_batches(hashes, size + 1, True, seed)[0], (n, k, seed, size)
    assert largest_filled_batch(np.zeros((5, 0), dtype=np.uint64), 0) == 5  # no text columns: nothing collides
