"""`cembed eval` with and without --dims is one path: one setup, one set of checks, one corpus-cache key."""

from __future__ import annotations

import pytest
from conftest import save_with_similarity, write_toy_beir

import cembed.eval.embedding_cache as embedding_cache
from cembed.errors import UserError
from cembed.eval.score import score_dims, score_model

DOCS = {f"d{i}": f"document number {i} about {topic}" for i, topic in enumerate(["cats", "dogs", "cars", "boats"])}
QUERIES = {"q1": "cats", "q2": "boats"}


def _beir(root):
    return write_toy_beir(root, DOCS, QUERIES, {"q1": {"d0"}, "q2": {"d3"}})


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


@pytest.mark.parametrize("similarity", ["dot", "euclidean"])
def test_a_dense_folder_is_evaluated_by_its_own_similarity(tiny_model_dir, tmp_path, similarity):
    """A folder saved with ``similarity_fn_name: dot`` (msmarco-*-dot, TAS-B) was scored by cosine. The
    reference: sentence-transformers' own InformationRetrievalEvaluator (no score_functions: the model's
    similarity) on the same folder; binary qrels, so its NDCG is cembed's graded one."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    folder = save_with_similarity(tiny_model_dir, tmp_path / "model", similarity)
    beir = _beir(tmp_path / "toy")
    report = score_model(str(folder), [beir], [], device="cpu", cache_dir=tmp_path / "cache")
    stock = InformationRetrievalEvaluator(
        QUERIES, DOCS, {"q1": {"d0"}, "q2": {"d3"}}, mrr_at_k=[10], ndcg_at_k=[10], name="toy-test"
    )(SentenceTransformer(str(folder), device="cpu"))
    assert stock[f"toy-test_{similarity}_ndcg@10"] == pytest.approx(
        report.sets["toy-test"]["headline"]["NDCG@10"], abs=1e-9
    )
    assert stock[f"toy-test_{similarity}_mrr@10"] == pytest.approx(
        report.sets["toy-test"]["headline"]["MRR@10"], abs=1e-9
    )
    assert f"toy-test_{similarity}_ndcg@10" in report.sets["toy-test"]["metrics"]
    dims = score_dims(str(folder), [beir], [], [32, 8], device="cpu", cache_dir=tmp_path / "cache")
    assert dims.scores[32]["toy-test"] == pytest.approx(report.sets["toy-test"]["headline"], abs=1e-9)
