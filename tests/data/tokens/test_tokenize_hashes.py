"""Row hashes computed inside the tokenizing map: each ``<role>_hash`` cell equals the sampler's hash of
the stored ids without the prompt's tokens (what ``row_hashes`` computes from the id columns), null
where the cell is null."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from datasets import Dataset
from sentence_transformers import SentenceTransformer

from cembed.data.identity import HASH_SUFFIX, hash_token_ids, row_hashes
from cembed.data.tokens.encode import SourcePrompts
from cembed.data.tokens.format import read_folder
from cembed.data.tokens.tokenize import pretokenize
from cembed.model.prompts import prompt_lengths

ROWS = {
    "anchor": ["A man on a bus.", "two dogs", "the RED car " * 30, "cat", "people at the street"],
    "positive": ["man riding bus", "Dogs playing in the snow", "car", "a cat sitting " * 20, "street"],
    "negative_1": ["blue room", "large black dog", None, None, None],  # rows 2..4: a source without it
}
ROLES = ["anchor", "positive", "negative_1"]


@pytest.fixture
def model(tiny_model_dir):
    m = SentenceTransformer(str(tiny_model_dir), device="cpu")
    m.max_seq_length = 24  # the long rows get truncated: the hash is of the stored (truncated) ids
    return m


def _expected(stored, role, skip):
    ids = pa.array(stored[role + "_input_ids"], type=pa.list_(pa.int32()))
    want = hash_token_ids(ids, skip).tolist()
    return [None if row is None else h for h, row in zip(want, stored[role + "_input_ids"])]


def test_hash_column_without_prompts_equals_hash_of_stored_ids(model, tmp_path):
    ds = Dataset.from_dict(ROWS)
    groups = [SourcePrompts(2, {}, {}), SourcePrompts(3, {}, {})]
    result = pretokenize(ds, ROLES, model.tokenizer, 24, tmp_path, sources=groups)
    _, stored = read_folder(result.cache_path)
    assert stored.features["anchor" + HASH_SUFFIX].dtype == "uint64"
    for role in ROLES:
        assert stored[role + HASH_SUFFIX] == _expected(stored, role, 0), role
    assert stored["negative_1" + HASH_SUFFIX][2:] == [None, None, None]
    # The same values the sampler computes today from the id columns (non-null cells).
    table = row_hashes(result.dataset.select_columns([f"{r}_input_ids" for r in ROLES] + ROLES), ROLES)
    for j, role in enumerate(ROLES):
        got = np.array([h if h is not None else 0 for h in stored[role + HASH_SUFFIX]], dtype=np.uint64)
        present = np.array([c is not None for c in ROWS[role]])
        assert (got[present] == table[present, j]).all(), role


def test_hash_column_skips_the_prompt_tokens(model, tmp_path):
    ds = Dataset.from_dict({k: v for k, v in ROWS.items() if k != "negative_1"})
    prompts = {"anchor": "query: "}
    lengths = prompt_lengths(model, prompts)
    assert lengths["anchor"] > 1
    result = pretokenize(
        ds, ["anchor", "positive"], model.tokenizer, 24, tmp_path, prompts=prompts, prompt_lengths=lengths
    )
    _, stored = read_folder(result.cache_path)
    assert stored["anchor_hash"] == _expected(stored, "anchor", np.asarray(stored["anchor_prompt_length"]))
    assert stored["anchor_hash"] != _expected(stored, "anchor", 0)  # the skip matters
    assert stored["positive_hash"] == _expected(stored, "positive", 0)


def test_hash_column_with_an_indices_mapping_keeps_the_texts(model, tmp_path):
    """A dataset with an indices mapping (a selection) keeps its texts in the entry beside the new columns."""
    ds = Dataset.from_dict({k: v for k, v in ROWS.items() if k != "negative_1"}).select([4, 2, 0])
    assert ds._indices is not None
    result = pretokenize(ds, ["anchor", "positive"], model.tokenizer, 24, tmp_path)
    assert result.dataset["anchor"] == [ROWS["anchor"][i] for i in (4, 2, 0)]
    assert result.dataset["anchor_input_ids"] == [
        model.tokenizer(t, truncation=True, max_length=24)["input_ids"] for t in result.dataset["anchor"]
    ]
    assert result.dataset["anchor_hash"] == _expected(result.dataset, "anchor", 0)
