"""The prepared-source checks of cembed.data.tokens.model_check, one at a time: each refusal's whole
message (what a user reads), which rows :func:`matches_model_preprocessing` compares (the first
``rows`` of each source), and the prompt field a role names. Written against mutation testing
(`make mutate`): each test here kills mutants the end-to-end tests in tests/data/sources/test_prepared.py let live."""

from __future__ import annotations

from dataclasses import dataclass, fields
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from sentence_transformers import SentenceTransformer

from cembed.data.tokens import model_check
from cembed.data.tokens.collator import PaddingCollator, collator_for
from cembed.data.tokens.encode import SourcePrompts
from cembed.data.tokens.model_check import check_prepared_for_model, matches_model_preprocessing, prompt_field
from cembed.data.tokens.tokenize import pretokenize
from cembed.errors import UserError

REDO = "or prepare the source again for this model (cembed prepare-data)"


@pytest.mark.parametrize(
    ("role", "field"),
    [("anchor", "anchor"), ("positive", "positive"), ("negative_1", "negatives"), ("negative_12", "negatives")],
)
def test_a_roles_prompt_field(role, field):
    assert prompt_field(role) == field


def _manifest(**changes):
    fields = dict(
        source_prompts=None, max_seq_length=64, tokenizer="tok-a", model="tiny", prompts={}, columns=["anchor"]
    )
    return SimpleNamespace(**{**fields, **changes})


@pytest.fixture
def fake_model(monkeypatch):
    # The fingerprint of a fake tokenizer is the tokenizer itself: these tests are about the comparison.
    monkeypatch.setattr(model_check, "tokenizer_fingerprint", lambda tokenizer: tokenizer)
    return SimpleNamespace(max_seq_length=64, tokenizer="tok-a")


def test_a_prepared_source_that_matches_the_model_passes(fake_model):
    manifest = _manifest(prompts={"anchor": "q: ", "positive": ""}, columns=["anchor", "positive"])
    check_prepared_for_model(fake_model, manifest, "data/p", {"anchor": "q: ", "positive": ""})
    check_prepared_for_model(fake_model, _manifest(), "data/p", None)


@pytest.mark.parametrize(
    ("manifest", "prompts", "message"),
    [
        (
            _manifest(source_prompts=[{"anchor": "q: "}]),
            None,
            "data/p: its sources were tokenized with prompts of their own, which one run's prompts cannot be "
            "checked against; train from the text sources it was made from, or prepare one source with "
            "cembed prepare-data",
        ),
        (
            _manifest(max_seq_length=32),
            None,
            f"data/p: max_seq_length: the model's is 64, the prepared source's 32; set model.max_seq_length: 32 {REDO}",
        ),
        (
            _manifest(tokenizer="tok-b"),
            None,
            "data/p: tokenizer: the model's fingerprint is tok-a, the prepared source's tok-b (prepared for tiny); "
            f"train the model it was prepared for {REDO}",
        ),
        (
            _manifest(tokenizer="tok-b", model=""),
            None,
            f"data/p: tokenizer: the model's fingerprint is tok-a, the prepared source's tok-b; train the model it was prepared for {REDO}",
        ),
        (
            _manifest(),
            {"anchor": "q: "},
            f"data/p: prompts.anchor: the run's is 'q: ', the prepared source's ''; set data.prompts.anchor to the source's {REDO}",
        ),
        (
            _manifest(columns=["anchor", "negative_1"], prompts={"negative_1": "p: "}),
            {"anchor": ""},
            "data/p: prompts.negative_1: the run's is '', the prepared source's 'p: '; "
            f"set data.prompts.negatives to the source's {REDO}",
        ),
    ],
)
def test_each_refusal_names_the_source_the_field_and_both_values(fake_model, manifest, prompts, message):
    with pytest.raises(UserError) as refused:
        check_prepared_for_model(fake_model, manifest, "data/p", prompts)
    assert str(refused.value) == message


ROLES = ["anchor", "negative_1", "positive"]  # a role without ids (negative_1) before one with


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    model.max_seq_length = 24
    return model


def _tokenized(tiny, tmp_path, n: int, sources=None, missing_negatives: int = 0):
    """``n`` rows tokenized as training tokenizes them; the first ``missing_negatives`` rows come from
    a source without negatives (null cells)."""
    rows = {
        "anchor": [f"question {i} about a car" for i in range(n)],
        "negative_1": [None if i < missing_negatives else f"the woman {i}" for i in range(n)],
        "positive": [f"answer text {i} with a dog" for i in range(n)],
    }
    return pretokenize(Dataset.from_dict(rows), ROLES, tiny.tokenizer, 24, tmp_path, sources=sources).dataset


def _with_text(dataset, row: int, column: str, text: str):
    """``dataset`` with one cell's text replaced after tokenizing: its stored ids no longer match it."""
    return dataset.map(lambda r, i: {column: text} if i == row else {}, with_indices=True)


def test_the_first_64_rows_are_compared_unless_told_otherwise(tiny, tmp_path):
    dataset = _with_text(_tokenized(tiny, tmp_path, 70), 64, "positive", "another text entirely")
    collator = collator_for(tiny, ROLES)
    assert matches_model_preprocessing(tiny, collator, dataset)
    assert not matches_model_preprocessing(tiny, collator, dataset, rows=65)


def test_the_first_rows_of_each_source_are_compared(tiny, tmp_path):
    sources = [SourcePrompts(4), SourcePrompts(4), SourcePrompts(4)]  # rows 0-3, 4-7, 8-11
    dataset = _tokenized(tiny, tmp_path, 12, sources=sources)
    collator = collator_for(tiny, ROLES)
    for row, compared in [(3, False), (4, True), (5, True), (6, False), (8, True), (9, True), (10, False)]:
        changed = _with_text(dataset, row, "positive", "another text entirely")
        assert matches_model_preprocessing(tiny, collator, changed, rows=2, sources=sources) is not compared, row


def test_ids_of_as_many_tokens_as_the_text_but_other_ones_do_not_match(tiny, tmp_path):
    # The same length: the masks agree, only the ids tell the texts apart.
    dataset = _with_text(_tokenized(tiny, tmp_path, 4), 2, "positive", "answer text 7 with a dog")
    same = tiny.preprocess(["answer text 7 with a dog", "answer text 2 with a dog"])["attention_mask"]
    assert same.all()  # neither is padded: as many tokens
    assert not matches_model_preprocessing(tiny, collator_for(tiny, ROLES), dataset)


def test_ids_stored_with_their_padding_do_not_match(tiny, tmp_path):
    # A row's ids with the tokenizer's padding kept (prepared with padding=True): the ids agree once
    # padded, the attention mask does not (the stored pads would train as tokens).
    rows = {"anchor": ["a car", "a long question about a red car on the street"], "positive": ["a dog", "an answer"]}
    dataset = pretokenize(Dataset.from_dict(rows), ["anchor", "positive"], tiny.tokenizer, 24, tmp_path).dataset
    collator = collator_for(tiny, ["anchor", "positive"])
    assert matches_model_preprocessing(tiny, collator, dataset)
    pad = tiny.tokenizer.pad_token_id
    padded = dataset.map(lambda r, i: {"anchor_input_ids": r["anchor_input_ids"] + [pad] * (i == 0)}, with_indices=True)
    assert not matches_model_preprocessing(tiny, collator, padded)


@dataclass
class _LeakyCollator(PaddingCollator):
    """A collator that puts a column into every batch, also one whose source does not map it."""

    def __call__(self, rows):
        batch = super().__call__(rows)
        batch.setdefault("negative_1_input_ids", torch.zeros((2, 1), dtype=torch.int64))
        return batch


def test_a_batch_that_carries_a_column_its_source_does_not_map_does_not_match(tiny, tmp_path):
    sources = [SourcePrompts(3), SourcePrompts(3)]
    dataset = _tokenized(tiny, tmp_path, 6, sources=sources, missing_negatives=3)
    leaky = _LeakyCollator(**{f.name: getattr(collator_for(tiny, ROLES), f.name) for f in fields(PaddingCollator)})
    assert not matches_model_preprocessing(tiny, leaky, dataset, rows=2, sources=sources)


def test_a_source_without_a_column_is_compared_on_its_other_columns(tiny, tmp_path):
    sources = [SourcePrompts(3), SourcePrompts(3)]
    dataset = _tokenized(tiny, tmp_path, 6, sources=sources, missing_negatives=3)
    collator = collator_for(tiny, ROLES)
    assert matches_model_preprocessing(tiny, collator, dataset, rows=2, sources=sources)
    changed = _with_text(dataset, 1, "positive", "another text entirely")  # after the null negative_1
    assert not matches_model_preprocessing(tiny, collator, changed, rows=2, sources=sources)


def _prepared_folder(folder):
    from cembed.config.data import DataConfig
    from cembed.data.load import load_training_data

    return folder, load_training_data(DataConfig.model_validate({"train": {"prepared": str(folder)}}))


def _prepared(tmp_path, tiny, samples=None):
    """A prepared folder of 80 pairs for ``tiny``, loaded as training loads it; ``samples`` replaces
    the manifest's sample texts."""
    from prepared_helpers import pair_rows, write_prepared

    from cembed.config.data import DataConfig
    from cembed.data.load import load_training_data
    from cembed.data.tokens.format import read_manifest, write_manifest

    folder = tmp_path / "prepared"
    write_prepared(folder, pair_rows(80), tiny.tokenizer, tiny.max_seq_length)
    if samples is not None:
        manifest = read_manifest(folder)
        manifest.samples = samples
        write_manifest(folder, manifest)
    return folder, load_training_data(DataConfig.model_validate({"train": {"prepared": str(folder)}}))


@pytest.fixture(scope="module")
def tiny64(tiny_model_dir):
    return SentenceTransformer(str(tiny_model_dir), device="cpu")


def test_the_prepared_stage_says_what_it_used(tmp_path, tiny64):
    folder, data = _prepared(tmp_path, tiny64)
    dataset, collator, info = model_check.prepared_stage(tiny64, data, None, 8)
    seconds = info.pop("seconds")
    assert info == {
        "pretokenized": True,
        "from_cache": True,
        "cache_path": str(folder),
        "prepared": data.manifest.fingerprint,
    }
    assert isinstance(seconds, float) and 0 <= seconds < 600 and seconds == round(seconds, 3)
    assert dataset is data.dataset and collator.roles == ["anchor", "positive"] and collator.pad_to_multiple_of == 8


def test_the_prepared_stage_refuses_a_manifest_without_samples_or_with_other_texts(tmp_path, tiny64):
    from cembed.files import display_path

    folder, data = _prepared(tmp_path, tiny64, samples={"anchor": ["question 0 about a car"]})
    with pytest.raises(UserError) as refused:
        model_check.prepared_stage(tiny64, data, None, None)
    assert str(refused.value) == (
        f"{display_path(folder)}: the manifest holds no sample text of column 'positive', so its ids cannot be "
        "checked against the model; write the first rows' texts into the manifest's samples"
    )
    folder, data = _prepared(tmp_path, tiny64, samples={"anchor": ["another text"], "positive": ["answer 0"]})
    with pytest.raises(UserError) as refused:
        model_check.prepared_stage(tiny64, data, None, None)
    assert str(refused.value) == (
        f"{display_path(folder)}: the stored token ids of the first 1 rows differ from the model's own preprocessing "
        "of the manifest's sample texts (another tokenizer, lower-casing or truncation); prepare the source "
        "again for this model"
    )


def test_the_prepared_stage_names_the_folder_in_the_checks_refusal(tmp_path, tiny64):
    from cembed.files import display_path

    folder, data = _prepared(tmp_path, tiny64)
    with pytest.raises(UserError) as refused:
        model_check.prepared_stage(tiny64, data, {"anchor": "q: "}, None)
    assert str(refused.value) == (
        f"{display_path(folder)}: prompts.anchor: the run's is 'q: ', the prepared source's ''; "
        f"set data.prompts.anchor to the source's {REDO}"
    )


def test_the_prepared_stage_names_the_sources_own_prompts_field(tmp_path, tiny64):
    from cembed.config.data import DataConfig
    from cembed.data.load import load_training_data

    folder, _ = _prepared(tmp_path, tiny64)
    data = load_training_data(
        DataConfig.model_validate({"train": {"prepared": str(folder), "prompts": {"anchor": "q: "}}})
    )
    with pytest.raises(UserError) as refused:
        model_check.prepared_stage(tiny64, data, {"anchor": "q: "}, None)
    assert str(refused.value).endswith(f"set data.train.prompts.anchor to the source's {REDO}")


def test_a_source_prepared_with_a_prompt_passes_the_check_with_that_prompt(
    tmp_path, tiny_model_dir, write_config, tiny64
):
    from prepared_helpers import pair_rows, write_jsonl

    from cembed.config.file import load_config
    from cembed.data.prepare_folder import prepare_folder

    corpus = write_jsonl(tmp_path / "pairs.jsonl", pair_rows(40))
    cfg = {
        "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
        "data": {"train": str(corpus), "prompts": {"anchor": "query: "}},
        "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 8},
    }
    prepare_folder(load_config(write_config(cfg)), tmp_path / "prepared")
    folder, data = _prepared_folder(tmp_path / "prepared")
    dataset, _, info = model_check.prepared_stage(tiny64, data, {"anchor": "query: "}, None)
    assert len(dataset) == 40 and info["prepared"] == data.manifest.fingerprint


def test_the_prepared_stage_refuses_a_model_that_pads_on_the_left(tmp_path, tiny_model_dir):
    from cembed.files import display_path

    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    folder, data = _prepared(tmp_path, model)
    model.tokenizer.padding_side = "left"
    with pytest.raises(UserError) as refused:
        model_check.prepared_stage(model, data, None, None)
    assert str(refused.value) == (
        f"{display_path(folder)}: the model's features are not plain token ids (or it pads on the left), so it "
        "cannot train on stored token ids; train it from the text source"
    )


def test_the_prepared_stage_compares_every_sample_row(tmp_path, tiny64):
    from prepared_helpers import pair_rows

    rows = pair_rows(80)
    samples = {c: [r[c] for r in rows] for c in ("anchor", "positive")}  # 80 samples: more than SAMPLE_ROWS
    samples["positive"][70] = "another text entirely"
    with pytest.raises(UserError, match="the stored token ids of the first 80 rows differ"):
        model_check.prepared_stage(tiny64, _prepared(tmp_path, tiny64, samples=samples)[1], None, None)
