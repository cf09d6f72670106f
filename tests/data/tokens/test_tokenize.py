"""Pre-tokenization: identical ids to on-the-fly tokenization, cache reuse and invalidation,
and training with dataloader workers."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.data_collator import SentenceTransformerDataCollator

from cembed.data.tokens.collator import collator_for
from cembed.data.tokens.format import MANIFEST, read_manifest
from cembed.data.tokens.model_check import matches_model_preprocessing
from cembed.data.tokens.tokenize import pretokenize

ROWS = {
    "anchor": ["A man on a bus.", "two dogs", "the RED car " * 30, "cat", "people at the street, near a table!"],
    "positive": ["man riding bus", "Dogs playing in the snow", "car", "a cat sitting " * 20, "street"],
    "negative_1": ["blue room", "large black dog", "small white car", "top of the bus", "the woman"],
}
ROLES = ["anchor", "positive", "negative_1"]


@pytest.fixture
def model(tiny_model_dir):
    m = SentenceTransformer(str(tiny_model_dir), device="cpu")
    m.max_seq_length = 24  # the long rows above get truncated
    return m


def test_pretokenized_batches_equal_on_the_fly(model, tmp_path):
    ds = Dataset.from_dict(ROWS)
    result = pretokenize(ds, ROLES, model.tokenizer, model.max_seq_length, tmp_path)
    collator = collator_for(model, ROLES)
    assert collator is not None
    stock = SentenceTransformerDataCollator(preprocess_fn=model.preprocess)
    rows = list(result.dataset)
    ours, ref = collator(rows), stock([{r: row[r] for r in ROLES} for row in rows])
    assert set(ours) == set(ref)
    for key, value in ref.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(ours[key], value), key
        else:
            assert ours[key] == value, key
    assert ref["anchor_input_ids"].shape[1] == 24  # truncation really happened
    assert matches_model_preprocessing(model, collator, result.dataset)


def test_cache_reused_and_rebuilt_on_max_seq_length_change(model, tmp_path):
    ds = Dataset.from_dict(ROWS)
    first = pretokenize(ds, ROLES, model.tokenizer, 24, tmp_path)
    second = pretokenize(ds, ROLES, model.tokenizer, 24, tmp_path)
    assert not first.from_cache and second.from_cache
    assert second.cache_path == first.cache_path
    assert second.dataset["anchor_input_ids"] == first.dataset["anchor_input_ids"]
    third = pretokenize(ds, ROLES, model.tokenizer, 16, tmp_path)
    assert not third.from_cache and third.cache_path != first.cache_path
    assert max(len(x) for x in third.dataset["anchor_input_ids"]) == 16
    # Different data -> different entry.
    other = pretokenize(Dataset.from_dict({k: v[::-1] for k, v in ROWS.items()}), ROLES, model.tokenizer, 24, tmp_path)
    assert not other.from_cache


@pytest.mark.slow
def test_training_with_two_workers_same_first_loss(tiny_model_dir, write_config, pairs_file, tmp_path, monkeypatch):
    """dataloader_num_workers: 2 gives the same first-step loss as 0 workers."""
    from cembed.config.file import load_config
    from cembed.train.recipe import check_run_inputs, run_training

    monkeypatch.setenv("CEMBED_CACHE_DIR", str(tmp_path / "cache"))
    rows = [{"anchor": f"question {i} about a {'red ' * (i % 7)}car", "positive": f"answer {i}"} for i in range(64)]
    train = pairs_file(rows)
    losses = []
    for workers in (0, 2):
        cfg = load_config(
            write_config(
                {
                    "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
                    "data": {"train": str(train)},
                    "batch": {"per_device_train_batch_size": 16, "mini_batch_size": 4},
                    "train": {
                        "max_steps": 2,
                        "logging_steps": 1,
                        "output_dir": str(tmp_path / f"w{workers}"),
                        "dataloader_num_workers": workers,
                    },
                }
            )
        )
        plan, data = check_run_inputs(cfg)
        summary = run_training(cfg, plan, data)
        assert summary["tokenization"]["pretokenized"] is True
        assert summary["tokenization"]["from_cache"] is (workers == 2)  # second run reuses the cache
        losses.append(summary["losses"][0][1])
        assert 0.0 <= summary["throughput"]["padded_share"] < 1.0
        assert (tmp_path / f"w{workers}" / "training_curves.png").exists()
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


def test_meter_interval_arithmetic(monkeypatch):
    """data_wait = waited / wall, tokens/s = real / wall, padded share = 1 - real / processed."""
    import cembed.train.meter as meter_mod
    from cembed.losses.counts import TokenCounts
    from cembed.train.meter import ThroughputMeter

    clock = iter([100.0, 110.0, 130.0, 130.0])
    monkeypatch.setattr(meter_mod.time, "perf_counter", lambda: next(clock))
    counts = TokenCounts()
    m = ThroughputMeter(counts)
    m.start()  # t=100
    m.waited(2.5)
    counts.real, counts.processed = 1000, 1250
    assert m.snapshot(step=5) == {"data_wait": 0.25, "tokens_per_s": 100.0, "padded_share": 0.2}  # t=110
    m.waited(1.0)
    counts.real, counts.processed = 400, 400
    assert m.snapshot(step=10) == {"data_wait": 0.05, "tokens_per_s": 20.0, "padded_share": 0.0}  # t=130
    assert m.totals() == {
        "data_wait": round(3.5 / 30, 4),
        "tokens_per_s": round(1400 / 30, 1),
        "padded_share": round(250 / 1650, 4),
    }
    assert [h["step"] for h in m.history] == [5, 10]


def test_num_proc_auto_uses_every_allowed_core_from_50k_rows(monkeypatch):
    import os

    from cembed.data.tokens.encode import resolve_num_proc

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(12)), raising=False)
    assert resolve_num_proc("auto", 50_000) == 12  # no 8-process cap
    assert resolve_num_proc(None, 1_000_000) == 12
    assert resolve_num_proc("auto", 49_999) == 1  # worker start-up costs more than it saves
    assert resolve_num_proc(3, 10) == 3  # an explicit count is taken as given


def test_num_proc_config_field(tmp_path):
    from cembed.config.file import config_from_dict
    from cembed.errors import UserError

    base = {"model": {"name_or_path": "m"}, "data": {"train": {"kind": "hub", "path": "x/y"}}}
    assert config_from_dict(base, base=tmp_path).data.num_proc == "auto"
    base["data"]["num_proc"] = 4
    assert config_from_dict(base, base=tmp_path).data.num_proc == 4
    base["data"]["num_proc"] = 0
    with pytest.raises(UserError, match="data.num_proc"):
        config_from_dict(base, base=tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("num_proc", [1, 2])
def test_parallel_tokenizing_gives_the_same_ids_and_reports_progress(model, tmp_path, num_proc):
    """Two processes: the same ids as one; progress ends at (rows, rows); one copy on disk (the
    entry's own files, nothing in datasets' cache next to the source)."""
    rows = {r: [f"{t} {i}" for i in range(300) for t in ROWS[r][:1]] for r in ROLES}
    ds = Dataset.from_dict(rows)
    seen = []
    result = pretokenize(
        ds, ROLES, model.tokenizer, 24, tmp_path, num_proc=num_proc, progress=lambda d, t: seen.append((d, t))
    )
    ref = [model.tokenizer(t, truncation=True, max_length=24)["input_ids"] for t in rows["anchor"]]
    assert result.dataset["anchor_input_ids"] == ref
    assert seen[-1] == (300, 300) and all(t == 300 and 0 <= d <= 300 for d, t in seen)
    files = sorted(p.name for p in result.cache_path.iterdir())
    parts = [f"part-{k:05d}.arrow" for k in range(num_proc)]  # the map's files, one per process
    assert files == sorted([MANIFEST, *parts])
    assert [p.name for p in result.cache_path.parent.iterdir() if p.name.startswith(".") and p.is_dir()] == []


def test_a_dead_writers_folder_is_removed_and_a_damaged_entry_rebuilt(model, tmp_path):
    ds = Dataset.from_dict(ROWS)
    first = pretokenize(ds, ROLES, model.tokenizer, 24, tmp_path)
    ids, entry = list(first.dataset["anchor_input_ids"]), first.cache_path
    del first
    stale = entry.parent / f".{entry.name}-killed"  # a writer killed mid-way leaves its folder
    stale.mkdir()
    (stale / "ids.arrow").write_bytes(b"half")
    (entry / read_manifest(entry).parts[0].file).write_bytes(b"damaged")
    again = pretokenize(ds, ROLES, model.tokenizer, 24, tmp_path)
    assert not again.from_cache and list(again.dataset["anchor_input_ids"]) == ids
    assert not stale.exists()


def test_a_second_writer_waits_for_the_first_and_loads_its_entry(model, tmp_path):
    import fcntl
    import threading
    import time

    from cembed.data.tokens.tokenize import cache_key

    ds = Dataset.from_dict(ROWS)
    key = cache_key(ds._fingerprint, model.tokenizer, 24, ROLES)
    root = tmp_path / "tokenized"
    root.mkdir()
    results = []
    with open(root / f".{key}.lock", "a") as held:  # another process is writing this entry
        fcntl.flock(held, fcntl.LOCK_EX)
        waiter = threading.Thread(target=lambda: results.append(pretokenize(ds, ROLES, model.tokenizer, 24, tmp_path)))
        waiter.start()
        time.sleep(1.0)
        assert waiter.is_alive() and not (root / key).exists()  # it waits, it does not write alongside
        fcntl.flock(held, fcntl.LOCK_UN)
    waiter.join(60)
    assert results and results[0].cache_path == root / key and not results[0].from_cache


@pytest.mark.parametrize("multiple", [None, 8])
def test_where_the_collator_tokenizes_an_ignored_pad_to_multiple_of_is_said(model, tmp_path, monkeypatch, multiple):
    # sentence-transformers' collator pads each batch to its longest row: batch.pad_to_multiple_of would do
    # nothing, so the fallback's warning says so (and only when it is set).
    import cembed.data.tokens.tokenize as tokenize
    from cembed.data.rows import TrainingData

    monkeypatch.setattr(tokenize, "matches_model_preprocessing", lambda *args, **kwargs: False)
    ds = Dataset.from_dict({"anchor": [f"q {i}" for i in range(8)], "positive": [f"d {i}" for i in range(8)]})
    dataset, collator, info = tokenize.tokenize_stage(
        model, TrainingData(ds, "pairs", 8), True, tmp_path, None, multiple
    )
    assert collator is None and dataset is ds
    ignored = (
        "batch.pad_to_multiple_of 8 is not applied: sentence-transformers' collator tokenizes each batch "
        "(stored ids differ from the model's preprocessing) and pads it to its longest row"
    )
    expected = tokenize.IDS_DIFFER_WARNING + (f"; {ignored}" if multiple else "")
    assert info == {
        "pretokenized": False,
        "reason": "stored ids differ from the model's preprocessing",
        "warning": expected,
    }

    monkeypatch.setattr(tokenize, "column_layouts", lambda *args, **kwargs: None)  # the model tokenizes per batch
    info = tokenize.tokenize_stage(model, TrainingData(ds, "pairs", 8), True, tmp_path, None, multiple)[2]
    reason = "the model tokenizes a column per batch"
    if multiple is None:
        assert info == {"pretokenized": False, "reason": reason}
    else:
        assert info["warning"] == (
            f"batch.pad_to_multiple_of 8 is not applied: sentence-transformers' collator tokenizes each batch "
            f"({reason}) and pads it to its longest row"
        )
