"""The BEIR file readers (cembed/data/sources/beir.py), shared by the beir training source and evaluation."""

from __future__ import annotations

import gzip
import json

import pytest

from cembed.data.sources.beir import beir_files, document_text, load_qrels, read_corpus, read_queries
from cembed.errors import UserError


def _folder(tmp_path):
    (tmp_path / "qrels").mkdir()
    with gzip.open(tmp_path / "corpus.jsonl.gz", "wt", encoding="utf-8") as f:
        for doc in [{"_id": "d1", "title": "Cats", "text": "sit on mats"}, {"_id": 2, "text": "dogs run"}]:
            f.write(json.dumps(doc) + "\n")
    (tmp_path / "queries.jsonl").write_text('{"_id": "q1", "text": "cat"}\n\n{"_id": "q2", "text": "dog"}\n')
    (tmp_path / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\r\nq1\td1\t1\r\nq2\t2\t2\r\nq1\td1\t3\r\n")
    return tmp_path


def test_a_folder_reads_as_written(tmp_path):
    corpus, queries, qrels = beir_files(_folder(tmp_path), "test")
    assert (corpus.name, queries.name, qrels.name) == ("corpus.jsonl.gz", "queries.jsonl", "test.tsv")
    assert read_corpus(corpus) == {"d1": "Cats sit on mats", "2": "dogs run"}  # ids as strings, title + text
    assert read_queries(queries) == {"q1": "cat", "q2": "dog"}  # the blank line skipped
    assert load_qrels(qrels) == {"q1": {"d1": 3}, "q2": {"2": 2}}  # header and CRLF; a repeat keeps its last score


def test_document_text_is_mtebs_rule():
    assert document_text("A", "b") == "A b"
    assert document_text(None, "b") == "b"
    assert document_text("A", None) == "A"


def test_a_missing_split_names_the_ones_there(tmp_path):
    with pytest.raises(UserError, match=r"split .dev. not found; available splits: test$"):
        beir_files(_folder(tmp_path), "dev")


def test_a_bad_qrels_line_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.tsv"
    bad.write_text("q1\td1\t1\nq2\td2\tx\n")
    with pytest.raises(UserError, match=r"bad\.tsv:2: score .x. is not a number"):
        load_qrels(bad)
