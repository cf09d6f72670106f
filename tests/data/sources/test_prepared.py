"""Reading a prepared source (issue 24 item 4): the config kind, the memory-mapped load, the sampler's
hashes from stored ids (and stored ``<role>_hash`` columns), and the checks against the model."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest
from prepared_helpers import pair_rows, write_jsonl, write_prepared
from pydantic import ValidationError
from sentence_transformers import SentenceTransformer

from cembed.config.data import DataConfig
from cembed.config.file import config_from_dict
from cembed.config.sources import PreparedSource
from cembed.data.batchable import check_batchable
from cembed.data.batching.full_table import NoDuplicatesSampler
from cembed.data.identity import HASH_SUFFIX, hash_token_ids, row_hashes
from cembed.data.load import load_training_data
from cembed.data.tokens.format import MANIFEST
from cembed.data.tokens.tokenize import pretokenize, tokenize_stage
from cembed.errors import UserError

ROWS = pair_rows(120)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return SentenceTransformer(str(tiny_model_dir), device="cpu")


@pytest.fixture
def prepared(tmp_path, tiny):
    folder = tmp_path / "prepared"
    write_prepared(folder, ROWS, tiny.tokenizer, tiny.max_seq_length)
    return folder


def _data(folder, **data):
    return DataConfig.model_validate({"train": {"prepared": str(folder)}, **data})


def test_the_prepared_kind_and_its_shorthand():
    cfg = DataConfig.model_validate({"train": {"prepared": "prep"}})
    assert isinstance(cfg.train, PreparedSource) and cfg.train.path == "prep"
    assert DataConfig.model_validate({"train": {"kind": "prepared", "path": "prep"}}).train == cfg.train


def test_a_relative_path_resolves_against_the_config_file(tmp_path):
    cfg = config_from_dict(
        {"model": {"name_or_path": "m"}, "data": {"train": {"prepared": "prep"}}}, base=tmp_path / "configs"
    )
    assert cfg.data.train.path == str(tmp_path / "configs" / "prep")


@pytest.mark.parametrize(
    "data, field",
    [
        ({"train": {"prepared": "p", "columns": {"anchor": "q"}}}, "train.columns"),
        ({"train": {"prepared": "p"}, "pretokenize": False}, "pretokenize"),
        ({"train": [{"prepared": "p"}, "pairs.jsonl"]}, "train"),
    ],
)
def test_mistakes_with_a_prepared_source_name_the_field(data, field):
    with pytest.raises(ValidationError) as err:
        DataConfig.model_validate(data)
    e = err.value.errors()[0]
    shown = ".".join(map(str, e["loc"])) + ": " + e["msg"]
    assert field + ":" in shown or ".".join(map(str, e["loc"])) == field, shown


def test_the_parts_are_memory_mapped_in_order_with_the_manifests_roles(prepared):
    data = load_training_data(_data(prepared))
    assert data.columns == ["anchor", "positive"] and data.source_columns() == [["anchor", "positive"]]
    assert (
        len(data.dataset) == 120
        and data.rows_read == 120
        and data.roles == {"anchor": "anchor", "positive": "positive"}
    )
    # No copy: the dataset's table is the parts' files, memory-mapped.
    assert [f["filename"] for f in data.dataset.cache_files] == [
        str(prepared / "part-00000.arrow"),
        str(prepared / "part-00001.arrow"),
    ]
    assert data.sample_texts() == {"anchor": [ROWS[0]["anchor"]], "positive": [ROWS[0]["positive"]]}
    assert data.first_row() == {"anchor": ROWS[0]["anchor"], "positive": ROWS[0]["positive"]}
    assert data.dataset[61]["anchor_input_ids"][:2] == [2, data.dataset[61]["anchor_input_ids"][1]]  # [CLS] first


def test_data_columns_of_the_config_that_prepared_it_are_accepted_others_named(prepared):
    # The same config with data.train swapped for the folder: its mapping gave the manifest's roles.
    same = load_training_data(_data(prepared, columns={"anchor": "query", "positive": "doc", "ignore": ["id"]}))
    assert same.columns == ["anchor", "positive"] and len(same.dataset) == 120
    with pytest.raises(
        UserError, match=r"^data.columns: maps the roles anchor, positive, negative_1, but the prepared"
    ):
        load_training_data(_data(prepared, columns={"anchor": "q", "positive": "d", "negatives": ["n"]}))


def test_a_missing_or_resized_part_is_named(prepared):
    data = (prepared / "part-00001.arrow").read_bytes()
    (prepared / "part-00001.arrow").write_bytes(data[:-8])
    with pytest.raises(UserError, match=r"part part-00001\.arrow is \d+ bytes, the manifest says"):
        load_training_data(_data(prepared))
    (prepared / "part-00001.arrow").unlink()
    with pytest.raises(UserError, match=r"part part-00001\.arrow is missing"):
        load_training_data(_data(prepared))


def test_a_part_that_is_not_an_arrow_stream_is_named(prepared):
    path = prepared / "part-00000.arrow"
    size = path.stat().st_size
    path.write_bytes(b"x" * size)  # same size: the manifest's check passes, the read fails
    with pytest.raises(UserError, match=r"part part-00000\.arrow: not an Arrow stream"):
        load_training_data(_data(prepared))


def test_a_folder_without_manifest_is_refused(prepared):
    (prepared / MANIFEST).unlink()
    with pytest.raises(UserError, match="not a prepared source"):
        load_training_data(_data(prepared))


def _text_path_table(tmp_path, tiny):
    """The text path's pre-tokenized dataset of the same rows (JSONL -> columns -> ids)."""
    from cembed.config.data import DataConfig

    text = load_training_data(DataConfig.model_validate({"train": str(write_jsonl(tmp_path / "pairs.jsonl", ROWS))}))
    return pretokenize(text.dataset, text.columns, tiny.tokenizer, tiny.max_seq_length, tmp_path / "cache").dataset


def test_hashes_of_a_prepared_table_equal_the_text_paths(prepared, tmp_path, tiny):
    data = load_training_data(_data(prepared))
    ids_only = row_hashes(data.dataset, data.columns)  # no text column: null from the ids column
    assert ids_only.shape == (120, 2)
    assert np.array_equal(ids_only, row_hashes(_text_path_table(tmp_path, tiny), ["anchor", "positive"]))
    # The sampler compares the roles, not the id columns, and defers the repeated positives as the
    # text path's sampler does: the same batches, which are not the plain shuffle's.
    sampler = NoDuplicatesSampler(data.dataset, batch_size=16, drop_last=True, seed=3)
    assert sampler.columns == ["anchor", "positive"] and sampler.compared_as.startswith("token ids")
    assert len(np.unique(sampler.hashes[:, 1])) == 100
    text = NoDuplicatesSampler(_text_path_table(tmp_path, tiny), batch_size=16, drop_last=True, seed=3)
    assert sampler.global_batches() == text.global_batches()
    plain = NoDuplicatesSampler(data.dataset, batch_size=16, drop_last=True, seed=3, no_duplicates=False)
    assert plain.global_batches() != sampler.global_batches()


def test_stored_hashes_are_used_and_equal_the_recomputed_ones(prepared):
    table = load_training_data(_data(prepared)).dataset.data.table
    recomputed = row_hashes(table, ["anchor", "positive"])
    stored = table
    for role in ["anchor", "positive"]:
        stored = stored.append_column(role + HASH_SUFFIX, pa.array(hash_token_ids(table.column(role + "_input_ids"))))
    assert np.array_equal(row_hashes(stored, ["anchor", "positive"]), recomputed)
    # Used, not recomputed: a stored value wins, and a null stored hash takes the row's first column's.
    marked = stored.set_column(
        stored.column_names.index("positive" + HASH_SUFFIX),
        "positive" + HASH_SUFFIX,
        pa.array([7] + [None] + recomputed[2:, 1].tolist(), pa.uint64()),
    )
    got = row_hashes(marked, ["anchor", "positive"])
    assert got[0, 1] == 7 and got[1, 1] == got[1, 0] and np.array_equal(got[2:], recomputed[2:])


def test_too_few_distinct_rows_for_a_batch_are_refused_by_hash(tmp_path, tiny):
    rows = [{"anchor": f"question {i}", "positive": "the same answer"} for i in range(40)]
    write_prepared(tmp_path / "p", rows, tiny.tokenizer, tiny.max_seq_length)
    data = load_training_data(_data(tmp_path / "p"))
    with pytest.raises(UserError, match=r"column 'positive' \(role positive\) has only 1 distinct texts"):
        check_batchable(data, 8, no_duplicates=True)
    check_batchable(data, 8, no_duplicates=False)


def _stage(data, model, prompts=None):
    return tokenize_stage(model, data, True, None, prompts)


def test_the_stored_ids_train_as_they_are(prepared, tiny):
    data = load_training_data(_data(prepared))
    dataset, collator, info = _stage(data, tiny)
    assert dataset is data.dataset and collator is not None and collator.roles == ["anchor", "positive"]
    assert info["pretokenized"] and info["prepared"] == data.manifest.fingerprint


def test_another_max_seq_length_is_refused(prepared, tiny_model_dir):
    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    model.max_seq_length = 32
    with pytest.raises(UserError, match=r"max_seq_length: the model's is 32, the prepared source's 64"):
        _stage(load_training_data(_data(prepared)), model)


def test_another_tokenizer_is_refused(tmp_path, tiny, tiny_model_dir):
    from transformers import AutoTokenizer

    cased = AutoTokenizer.from_pretrained(str(tiny_model_dir), do_lower_case=False)
    write_prepared(tmp_path / "p", ROWS, cased, tiny.max_seq_length)
    with pytest.raises(UserError, match=r"tokenizer: the model's fingerprint is [0-9a-f]{16}, the prepared source's"):
        _stage(load_training_data(_data(tmp_path / "p")), tiny)


def test_other_prompts_are_refused(prepared, tiny):
    with pytest.raises(UserError, match=r"prompts\.anchor: the run's is 'query: ', the prepared source's ''"):
        _stage(load_training_data(_data(prepared)), tiny, {"anchor": "query: "})


def test_ids_that_differ_from_the_models_preprocessing_are_refused(prepared, tiny):
    manifest = json.loads((prepared / MANIFEST).read_text())
    manifest["samples"]["positive"][3] = "another text than the one tokenized"  # the fingerprint does not cover samples
    (prepared / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="stored token ids of the first 64 rows differ from the model's own"):
        _stage(load_training_data(_data(prepared)), tiny)


def _rewrite_part(folder, name, table):
    """Replace a part (as an engine that wrote it differently would) and publish the manifest again."""
    from cembed.data.tokens.format import read_manifest, write_manifest

    manifest = read_manifest(folder)
    with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    for part in manifest.parts:
        if part.file == name:
            part.bytes = (folder / name).stat().st_size
    write_manifest(folder, manifest)


def test_parts_without_a_roles_ids_or_with_other_columns_are_named(prepared):
    # Read into memory (not mapped: the file is rewritten below).
    table = pa.ipc.open_stream(pa.BufferReader((prepared / "part-00001.arrow").read_bytes())).read_all()
    _rewrite_part(
        prepared, "part-00001.arrow", table.append_column("anchor_prompt_length", pa.array([0] * 60, pa.int32()))
    )
    with pytest.raises(
        UserError, match=r"part part-00001\.arrow's columns \(.*anchor_prompt_length\) differ from part-00000"
    ):
        load_training_data(_data(prepared))
    _rewrite_part(prepared, "part-00001.arrow", table.drop_columns(["positive_input_ids"]))
    with pytest.raises(UserError, match=r"part part-00001\.arrow: no column positive_input_ids"):
        load_training_data(_data(prepared))
