"""`cembed eval` with and without --dims is one path: one setup, one set of checks, one corpus-cache key."""

from __future__ import annotations

import json

import pytest

import cembed.eval.embedding_cache as embedding_cache
from cembed.errors import UserError
from cembed.eval.score import score_dims, score_model

DOCS = {f"d{i}": f"document number {i} about {topic}" for i, topic in enumerate(["cats", "dogs", "cars", "boats"])}
QUERIES = {"q1": "cats", "q2": "boats"}


def _beir(root):
    root.mkdir(parents=True)
    (root / "corpus.jsonl").write_text("".join(json.dumps({"_id": i, "text": t}) + "\n" for i, t in DOCS.items()))
    (root / "queries.jsonl").write_text("".join(json.dumps({"_id": i, "text": t}) + "\n" for i, t in QUERIES.items()))
    (root / "qrels").mkdir()
    (root / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td0\t1\nq2\td3\t1\n")
    return root


@pytest.fixture
def count_encodes(monkeypatch):
    calls = []
    real = embedding_cache.encode_documents

    def counting(model, texts, *args, **kwargs):
        calls.append(len(texts))
        return real(model, texts, *args, **kwargs)

    monkeypatch.setattr(embedding_cache, "encode_documents", counting)
    return calls


def test_eval_dims_after_eval_reuses_the_corpus_cache_entry(tiny_model_dir, tmp_path, count_encodes):
    beir = _beir(tmp_path / "toy")
    cache = tmp_path / "cache"
    plain = score_model(str(tiny_model_dir), [beir], [], device="cpu", cache_dir=cache)
    assert count_encodes == [len(DOCS)]
    entry = plain.sets["toy-test"]
    assert not entry["corpus_cache_hit"] and entry["corpus_cache"].startswith(str(cache / "embeddings"))

    dims = score_dims(str(tiny_model_dir), [beir], [], [32, 8], device="cpu", cache_dir=cache)
    assert count_encodes == [len(DOCS)]  # the --dims run read the corpus from the cache: no second encode
    assert [p.name for p in (cache / "embeddings").glob("*.npy")] == [entry["corpus_cache"].rsplit("/", 1)[-1]]
    assert list(cache.iterdir()) == [cache / "embeddings"]
    assert dims.scores[32]["toy-test"] == pytest.approx(entry["headline"], abs=1e-9)  # full size = plain eval

    # and the other way round: plain eval after --dims hits the same entry
    again = score_model(str(tiny_model_dir), [beir], [], device="cpu", cache_dir=cache)
    assert again.sets["toy-test"]["corpus_cache_hit"] and count_encodes == [len(DOCS)]


def test_eval_dims_has_the_same_checks_as_eval(tiny_model_dir, tmp_path):
    beir = _beir(tmp_path / "toy")
    copy = _beir(tmp_path / "other" / "toy")
    for score in (
        lambda **kw: score_model(str(tiny_model_dir), device="cpu", no_cache=True, **kw),
        lambda **kw: score_dims(str(tiny_model_dir), dims=[8], device="cpu", no_cache=True, **kw),
    ):
        with pytest.raises(UserError, match=r"--json .*: is a folder"):
            score(retrieval=[beir], sts=[], json_out=tmp_path)
        with pytest.raises(UserError, match=r"two sets are named 'toy-test'"):
            score(retrieval=[beir, copy], sts=[])
        with pytest.raises(UserError, match=r"give at least one --retrieval FOLDER or --sts FILE"):
            score(retrieval=[], sts=[])
