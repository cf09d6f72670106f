"""Retrieval for a multi-vector model (issue 40 item 4): exact MaxSim over a BEIR folder, scored in tiles
over ragged token vectors, gives sentence-transformers' own ``MultiVectorInformationRetrievalEvaluator``
metrics; the corpus is cached ragged and read back to the same metrics; its scores are the model's
``similarity``; STS and ``--dims``, which assume one vector per text, are refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

from cembed.config.model import model_config
from cembed.errors import UserError
from cembed.eval.evaluators import evaluate_retrieval, retrieval_evaluator
from cembed.eval.maxsim_retrieval import MaxSimIREvaluator, ragged
from cembed.eval.score import score_dims, score_model
from cembed.eval.sets import load_beir
from cembed.model.load import load_model
from cembed.model.maxsim import Tiles, maxsim_scores

WORDS = "man woman people dog cat train table street car room plate food bus red blue white black two".split()


@pytest.fixture(scope="module")
def beir(tmp_path_factory):
    """A BEIR folder: 40 documents, 12 queries with one or two relevant documents each."""
    folder = tmp_path_factory.mktemp("beir")
    docs = {f"d{i}": " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(3 + i % 9)) for i in range(40)}
    queries = {f"q{i}": " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(2 + i % 3)) for i in range(12)}
    (folder / "corpus.jsonl").write_text(
        "".join(json.dumps({"_id": k, "title": "", "text": v}) + "\n" for k, v in docs.items())
    )
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": k, "text": v}) + "\n" for k, v in queries.items()))
    (folder / "qrels").mkdir()
    lines = (
        ["query-id\tcorpus-id\tscore"]
        + [f"q{i}\td{i}\t1" for i in range(12)]
        + [f"q{i}\td{i + 20}\t1" for i in range(0, 12, 3)]
    )
    (folder / "qrels" / "test.tsv").write_text("\n".join(lines) + "\n")
    return folder


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(model_config(kind="multi_vector", name_or_path=str(tiny_model_dir), dim=16), "cpu", seed=2).eval()


KEYS = ("ndcg@10", "mrr@10", "recall@10", "recall@100", "precision@1", "accuracy@3")


def test_metrics_equal_the_stock_multi_vector_evaluator(model, beir, tmp_path):
    from sentence_transformers.multi_vector_encoder.evaluation import MultiVectorInformationRetrievalEvaluator

    rs = load_beir(beir)
    stock = MultiVectorInformationRetrievalEvaluator(
        rs.queries, rs.corpus, rs.relevant_docs, name=rs.name, precision_recall_at_k=[1, 3, 5, 10, 100]
    )(model)
    ours, corpus = evaluate_retrieval(model, rs, cache_dir=tmp_path)
    assert not corpus.cache_hit and corpus.offsets is not None and corpus.cache_file.endswith(".npz")
    for key in KEYS:
        assert ours[f"{rs.name}_maxsim_{key}"] == pytest.approx(stock[f"{rs.name}_maxsim_{key}"], abs=1e-6), key
    again, corpus = evaluate_retrieval(model, rs, cache_dir=tmp_path)
    assert corpus.cache_hit and again == ours  # the ragged cache reads back to the same scores
    assert ours[f"{rs.name}_maxsim_ndcg@10"] > 0


def test_scores_are_the_models_similarity_whatever_the_tiles(model, beir):
    rs = load_beir(beir)
    queries = model.encode_query(list(rs.queries.values()))
    documents = model.encode_document(list(rs.corpus.values()))
    reference = model.similarity(queries, documents)
    for tiles in (Tiles(), Tiles(7, 11, 3)):
        torch.testing.assert_close(
            maxsim_scores(ragged(queries), ragged(documents), tiles), reference, rtol=1e-5, atol=1e-5
        )
    evaluator = retrieval_evaluator(rs, similarity="maxsim")
    assert isinstance(evaluator, MaxSimIREvaluator) and evaluator.score_function_names == ["maxsim"]


def test_sts_and_dims_are_refused_for_a_multi_vector_model(model, beir, tmp_path):
    from conftest import STS_TEST

    saved = tmp_path / "mv"
    model.save(str(saved))
    with pytest.raises(UserError, match=r"^--sts: .* scores a query and a document by maxsim, not one vector per text"):
        score_model(str(saved), [beir], [STS_TEST], no_cache=True)
    with pytest.raises(UserError, match=r"^--dims: .* is not a dense model \(it scores by maxsim\)"):
        score_dims(str(saved), [beir], [], [8], no_cache=True)
    report = score_model(str(saved), [beir], [], no_cache=True)
    assert set(report.sets[load_beir(beir).name]["headline"]) == {
        "NDCG@10",
        "MRR@10",
        "MAP@100",
        "Recall@10",
        "Recall@100",
    }
