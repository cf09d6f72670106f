"""A BEIR folder as a training source: ``data.train: {beir: folder, split: train}``."""

from __future__ import annotations

import json

import pytest
from conftest import SHARED_DATA

from cembed.config.file import load_config
from cembed.config.sources import BeirSource
from cembed.data.load import load_training_data
from cembed.errors import UserError


def _beir(folder, qrels: str):
    (folder / "qrels").mkdir(parents=True)
    docs = [{"_id": "d1", "title": "Title one", "text": "text one"}, {"_id": "d2", "title": "", "text": "text two"}]
    docs.append({"_id": "d3", "title": "Only title", "text": ""})
    (folder / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    queries = [{"_id": f"q{i}", "text": f"query {i}"} for i in range(1, 4)]
    (folder / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    (folder / "qrels" / "train.tsv").write_text(qrels)
    return folder


def test_beir_yaml_form_builds_pairs_from_positive_qrels(tmp_path, write_config):
    _beir(tmp_path / "beir", "query-id\tcorpus-id\tscore\nq1\td1\t1\nq2\td2\t0\nq2\td1\t2\r\nq3\td3\t1\n")
    cfg = load_config(write_config({"data": {"train": {"beir": "beir", "split": "train"}}}))
    assert cfg.data.train == BeirSource(path=str(tmp_path / "beir"), split="train")  # relative to the config
    data = load_training_data(cfg.data)
    assert data.dataset["anchor"] == ["query 1", "query 2", "query 3"]  # q2-d2 (score 0) dropped
    assert data.dataset["positive"] == ["Title one text one", "Title one text one", "Only title"]
    assert data.columns == ["anchor", "positive"] and data.rows_read == 3
    assert "qrels/train.tsv" in data.source


def test_beir_missing_document_names_qrels_file_and_line(tmp_path, write_config):
    _beir(tmp_path / "beir", "q1\td1\t1\nq2\td9\t1\n")
    cfg = load_config(write_config({"data": {"train": {"beir": str(tmp_path / "beir")}}}))
    qrels = tmp_path / "beir" / "qrels" / "train.tsv"
    with pytest.raises(UserError, match=rf"^{qrels}:2: corpus-id 'd9' \(query 'q2'\) is not in corpus.jsonl$"):
        load_training_data(cfg.data)


def test_beir_missing_split_lists_the_available_ones(tmp_path, write_config):
    _beir(tmp_path / "beir", "q1\td1\t1\n")
    cfg = load_config(write_config({"data": {"train": {"beir": "beir", "split": "dev"}}}))
    with pytest.raises(UserError, match=r"qrels file for split 'dev' not found; available splits: train"):
        load_training_data(cfg.data)


def test_beir_key_with_path_is_refused(tmp_path, write_config):
    with pytest.raises(UserError, match=r"give the BEIR folder as `beir: <folder>` without `path` or `kind`"):
        load_config(write_config({"data": {"train": {"beir": "x", "path": "y"}}}))


@pytest.mark.skipif(not (SHARED_DATA / "scifact").exists(), reason="../shared/data is not present")
def test_scifact_train_gives_919_pairs_and_565_abstracts(write_config):
    cfg = load_config(write_config({"data": {"train": {"beir": str(SHARED_DATA / "scifact"), "split": "train"}}}))
    data = load_training_data(cfg.data)
    assert len(data.dataset) == 919 and data.rows_dropped == 0
    assert len(set(data.dataset["positive"])) == 565
