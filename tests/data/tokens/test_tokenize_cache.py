"""The tokenize cache stores the one on-disk format (issue 31 item 2): a cache entry is a prepared
folder, written by prepare-data's writer and read by its reader, so an entry and a ``prepare-data``
folder of the same config hold byte-identical id columns; its manifest reads with ``read_manifest``;
an entry of the old layout is a miss, never an error; version-1 prepared folders still read."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pyarrow as pa
import pytest
import xxhash
from datasets import Dataset
from prepared_helpers import pair_rows, write_prepared
from sentence_transformers import SentenceTransformer

from cembed.config.data import DataConfig
from cembed.config.file import load_config
from cembed.data.load import load_training_data
from cembed.data.prepare_folder import prepare_folder
from cembed.data.prompts import training_prompts
from cembed.data.tokens.encode import SourcePrompts
from cembed.data.tokens.format import MANIFEST, VERSION, parts_fingerprint, read_folder, read_manifest
from cembed.data.tokens.tokenize import cache_key, pretokenize, tokenize_stage
from cembed.errors import UserError
from cembed.model.fingerprint import tokenizer_fingerprint
from cembed.model.load import load_model
from cembed.model.prompts import prompt_lengths

ROWS = 2600  # two map batches of 2048 rows in one part
ROLES = ["anchor", "positive"]


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "DOWNLOADED_DATASETS_PATH", cache / "downloads")
    monkeypatch.setattr(datasets.config, "EXTRACTED_DATASETS_PATH", cache / "downloads" / "extracted")
    return cache


@pytest.fixture
def model(tiny_model_dir):
    m = SentenceTransformer(str(tiny_model_dir), device="cpu")
    m.max_seq_length = 16
    return m


def prompt_length(model) -> int:
    return prompt_lengths(model, {"anchor": "query: "})["anchor"]


def _column_bytes(table: pa.Table, name: str) -> tuple[bytes, ...]:
    """A column's content as the bytes Arrow holds it: its null mask, and for a list column its
    offsets (from 0) and its int32 values, else its values (nulls as 0); its chunks combined, so
    how the record batches were cut does not count."""
    column = table.column(name).combine_chunks()
    nulls = column.is_null().to_numpy(zero_copy_only=False).tobytes()
    if pa.types.is_list(column.type):
        offsets = column.offsets.to_numpy()
        return nulls, (offsets - offsets[0]).tobytes(), column.flatten().to_numpy().tobytes()
    return nulls, column.fill_null(0).to_numpy().tobytes()


def test_a_cache_entry_and_a_prepare_data_folder_hold_byte_identical_ids(
    tiny_model_dir, write_config, pairs_file, tmp_path, hf_cache
):
    """Training's tokenize stage and ``cembed prepare-data`` of one config (one prompt, truncation)
    write the same parts: the id, hash and prompt-length columns are equal byte for byte, and the
    manifests' fingerprints (part names, rows, sizes, tokenizer, length, columns, prompts) are equal."""
    corpus = pairs_file(
        [
            {"query": f"question {i} about a {'red ' * (i % 5)}car", "text": f"answer {i} {'x ' * (i % 9)}"}
            for i in range(ROWS)
        ]
    )
    cfg = load_config(
        write_config(
            {
                "model": {"name_or_path": str(tiny_model_dir), "device": "cpu", "max_seq_length": 16},
                "data": {
                    "train": str(corpus),
                    "columns": {"anchor": "query", "positive": "text"},
                    "prompts": {"anchor": "query: "},
                    "cache_dir": str(tmp_path / "cache"),
                    "num_proc": 1,
                },
            }
        )
    )
    # The training path: what `cembed train` runs before its first step.
    data = load_training_data(cfg.data)
    model = load_model(cfg.model, "cpu")
    prompts = training_prompts(data, model, cfg.data.prompts).columns
    _, collator, info = tokenize_stage(model, data, True, cfg.data.cache_dir, prompts, num_proc=cfg.data.num_proc)
    assert info["pretokenized"] is True and info["from_cache"] is False and collator is not None
    entry = Path(info["cache_path"])
    assert entry.parent == tmp_path / "cache" / "tokenized"

    folder = prepare_folder(cfg, tmp_path / "prepared").folder
    cached, cached_rows = read_folder(entry)  # the one reader, for both
    prepared, prepared_rows = read_folder(folder)
    a, b = cached_rows.data.table, prepared_rows.data.table
    columns = [
        "anchor_input_ids",
        "anchor_hash",
        "positive_input_ids",
        "positive_hash",
        "anchor_prompt_length",
    ]
    assert a.column_names == b.column_names == columns  # the cache keeps no text either
    for name in columns:
        assert a.column(name).to_pylist() == b.column(name).to_pylist(), name
        assert _column_bytes(a, name) == _column_bytes(b, name), name
        assert a.column(name).type == b.column(name).type, name
    assert a.num_rows == ROWS and set(a.column("anchor_prompt_length").to_pylist()) == {prompt_length(model)}
    assert a.column("anchor_input_ids").type == pa.list_(pa.int32())

    # The same parts (names, rows, sizes), so the same fingerprint; the cache's manifest adds its key.
    # (The files' bytes may differ only in datasets' own metadata: the map's fingerprint.)
    assert [p.file for p in cached.parts] == [p.file for p in prepared.parts] == ["part-00000.arrow"]
    assert a.schema.remove_metadata() == b.schema.remove_metadata() and a.equals(b)
    assert cached.fingerprint == prepared.fingerprint
    for key in ("columns", "tokenizer", "max_seq_length", "rows", "prompts", "samples", "version"):
        assert getattr(cached, key) == getattr(prepared, key), key
    assert cached.cache_key == entry.name and cached.data_fingerprint == data.dataset._fingerprint
    assert prepared.cache_key == "" and prepared.data_fingerprint == ""
    assert sorted(p.name for p in entry.iterdir()) == [MANIFEST, "part-00000.arrow"]


def test_the_cache_entrys_manifest_reads_with_read_manifest(model, tmp_path):
    rows = {"anchor": [f"question {i}" for i in range(70)], "positive": [f"answer {i}" for i in range(70)]}
    ds = Dataset.from_dict(rows)
    result = pretokenize(ds, ["anchor", "positive"], model.tokenizer, 16, tmp_path)
    manifest = read_manifest(result.cache_path)  # checks parts, sizes and fingerprint
    assert manifest.version == VERSION == 2
    assert manifest.cache_key == result.cache_path.name == cache_key(ds._fingerprint, model.tokenizer, 16, ROLES)
    assert manifest.data_fingerprint == ds._fingerprint
    assert manifest.columns == ROLES and manifest.rows == 70 and manifest.max_seq_length == 16
    assert manifest.tokenizer == tokenizer_fingerprint(model.tokenizer)
    assert manifest.prompts == {} and manifest.source_prompts == [] and manifest.text_columns == []
    assert manifest.samples["anchor"] == rows["anchor"][:64]
    assert manifest.fingerprint == parts_fingerprint(manifest)
    # A selection (an indices mapping) keeps its texts in the entry: the manifest says which.
    picked = pretokenize(ds.select([5, 3, 1]), ROLES, model.tokenizer, 16, tmp_path)
    assert read_manifest(picked.cache_path).text_columns == ROLES
    assert picked.dataset["anchor"] == ["question 5", "question 3", "question 1"]


def _old_entry(folder, ids_from, rows: int) -> None:
    """An entry as cembed wrote it before the one format: the map's ``ids.arrow`` and the untyped
    ``cembed_tokenized.json`` manifest (files, rows, texts, features)."""
    folder.mkdir(parents=True)
    manifest = read_manifest(ids_from)
    (folder / "ids.arrow").write_bytes((ids_from / manifest.parts[0].file).read_bytes())
    features = read_folder(ids_from)[1].features.to_dict()
    meta = {"files": ["ids.arrow"], "rows": rows, "texts": False, "features": features}
    (folder / "cembed_tokenized.json").write_text(json.dumps(meta))


def test_an_old_format_cache_entry_is_a_miss_not_an_error(model, tmp_path):
    rows = {"anchor": [f"question {i} about a red car" for i in range(40)], "positive": [f"a {i}" for i in range(40)]}
    ds = Dataset.from_dict(rows)
    wrong = pretokenize(ds, ROLES, model.tokenizer, 8, tmp_path / "other")  # other ids: a hit would show
    root = tmp_path / "tokenized"
    # Where the old cembed put it (its key, format version 3): never looked at again.
    old_key = xxhash.xxh64_hexdigest(
        "|".join(["3", ds._fingerprint, tokenizer_fingerprint(model.tokenizer), "16", ",".join(ROLES)]).encode()
    )
    _old_entry(root / old_key, wrong.cache_path, 40)
    # And the worst case: an old-layout folder under this cembed's key.
    key = cache_key(ds._fingerprint, model.tokenizer, 16, ROLES)
    assert key != old_key
    _old_entry(root / key, wrong.cache_path, 40)

    result = pretokenize(ds, ROLES, model.tokenizer, 16, tmp_path)
    assert result.from_cache is False and result.cache_path == root / key  # tokenized again
    want = [model.tokenizer(t, truncation=True, max_length=16)["input_ids"] for t in rows["anchor"]]
    assert result.dataset["anchor_input_ids"] == want
    assert sorted(p.name for p in (root / key).iterdir()) == [MANIFEST, "part-00000.arrow"]
    assert (root / old_key / "cembed_tokenized.json").exists()  # a miss: left as it was
    again = pretokenize(ds, ROLES, model.tokenizer, 16, tmp_path)
    assert again.from_cache is True and again.dataset["anchor_input_ids"] == want


def test_an_empty_dataset_is_not_cached_and_has_the_id_columns(model, tmp_path):
    ds = Dataset.from_dict({"anchor": [], "positive": []})
    result = pretokenize(ds, ROLES, model.tokenizer, 16, tmp_path)
    assert result.cache_path is None and not result.from_cache and len(result.dataset) == 0
    assert result.dataset.column_names == ["anchor", "positive", "anchor_input_ids", "anchor_hash"] + [
        "positive_input_ids",
        "positive_hash",
    ]
    assert not (tmp_path / "tokenized").exists()


def test_a_cache_entry_trains_as_a_prepared_source(model, tmp_path):
    """Being a prepared folder, an entry reads as a ``prepared`` source and passes its model checks;
    an entry of sources with prompts of their own is refused there, in one line."""
    rows = pair_rows(120)
    ds = Dataset.from_dict({r: [row[r] for row in rows] for r in ROLES})
    entry = pretokenize(ds, ROLES, model.tokenizer, 16, tmp_path).cache_path
    data = load_training_data(DataConfig.model_validate({"train": {"prepared": str(entry)}}))
    assert data.columns == ROLES and len(data.dataset) == 120 and data.manifest.cache_key == entry.name
    dataset, collator, info = tokenize_stage(model, data, True, None)
    assert collator is not None and info["prepared"] == data.manifest.fingerprint

    groups = [SourcePrompts(60, {"anchor": "query: "}, {"anchor": 3}), SourcePrompts(60, {}, {})]
    mixed = pretokenize(ds, ROLES, model.tokenizer, 16, tmp_path, sources=groups).cache_path
    manifest = read_manifest(mixed)
    assert manifest.prompts == {} and [(g.rows, g.prompts) for g in manifest.source_prompts] == [
        (60, {"anchor": "query: "}),
        (60, {}),
    ]
    data = load_training_data(DataConfig.model_validate({"train": {"prepared": str(mixed)}}))
    with pytest.raises(UserError, match=r"^.*: its sources were tokenized with prompts of their own"):
        tokenize_stage(model, data, True, None)


def test_a_version_1_prepared_folder_still_reads_and_a_newer_one_is_refused(model, tmp_path):
    folder = tmp_path / "v1"
    write_prepared(folder, pair_rows(40), model.tokenizer, 16)
    raw = json.loads((folder / MANIFEST).read_text())
    for key in ("cache_key", "data_fingerprint", "text_columns", "source_prompts"):
        del raw[key]  # what cembed wrote before version 2
    raw["version"] = 1
    (folder / MANIFEST).write_text(json.dumps(raw))
    manifest, rows = read_folder(folder)
    assert manifest.version == 1 and manifest.rows == 40 and len(rows) == 40
    assert manifest.fingerprint == raw["fingerprint"]  # version 1's fingerprint still verifies
    raw["version"] = 3
    (folder / MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(
        UserError, match=r"unreadable prepared-source manifest \(version 3, this cembed reads 1 and 2\)"
    ):
        read_manifest(folder)
