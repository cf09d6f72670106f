"""Exact dot-product retrieval of a sparse model (issue 41 items 1, 3): the evaluator's NDCG@10 (graded) and MRR@10
are those of ranking every document by the dot product of the model's own sparse query and document
embeddings, and it reports the queries' and the documents' mean active dimensions; over a BEIR folder its
metrics are sentence-transformers' ``SparseInformationRetrievalEvaluator``'s; the corpus is cached as CSR and
read back to the same metrics; ``cembed eval`` shows the active dimensions and refuses STS and ``--dims``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import STS_TEST, TEXTS, make_tiny_splade

from cembed.errors import UserError
from cembed.eval.evaluators import evaluate_retrieval
from cembed.eval.metrics import graded_ndcg_at_k
from cembed.eval.score import score_dims, score_model
from cembed.eval.sets import load_beir
from cembed.eval.sparse_retrieval import SparseIREvaluator


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_splade(tmp_path_factory.mktemp("splade"), bias=-0.1).eval()


def test_sparse_retrieval_ranks_by_the_dot_product_of_the_sparse_embeddings(model):
    queries = {f"q{i}": t for i, t in enumerate(TEXTS["anchor"])}
    corpus = {f"d{i}": t for i, t in enumerate(TEXTS["positive"] + TEXTS["negative_1"])}
    relevant = {f"q{i}": {f"d{i}"} for i in range(len(queries))}
    relevance = {"q0": {"d0": 2}}  # a graded qrel
    evaluator = SparseIREvaluator(
        queries=queries, corpus=corpus, relevant_docs=relevant, relevance=relevance, name="toy",
        mrr_at_k=[10], ndcg_at_k=[10], accuracy_at_k=[1], precision_recall_at_k=[10], map_at_k=[100],
    )  # fmt: skip
    metrics = evaluator(model)
    q = model.encode_query(list(queries.values()), convert_to_tensor=True).to_dense()
    d = model.encode_document(list(corpus.values()), convert_to_tensor=True).to_dense()
    scores = q @ d.T
    ids = list(corpus)
    ndcg, rr = [], []
    for i, qid in enumerate(queries):
        ranked = [ids[j] for j in sorted(range(len(ids)), key=lambda j: (-scores[i, j].item(), ids[j]))]
        grades = {doc: relevance.get(qid, {}).get(doc, 1) for doc in relevant[qid]}
        ndcg.append(graded_ndcg_at_k(ranked, grades, 10))
        rank = ranked.index(f"d{i}")
        rr.append(1 / (rank + 1) if rank < 10 else 0.0)
    assert metrics["toy_dot_ndcg@10"] == pytest.approx(sum(ndcg) / len(ndcg), abs=1e-9)
    assert metrics["toy_dot_mrr@10"] == pytest.approx(sum(rr) / len(rr), abs=1e-9)
    assert metrics["toy_query_active_dims"] == pytest.approx((q != 0).sum(dim=1).float().mean().item())
    assert metrics["toy_corpus_active_dims"] == pytest.approx((d != 0).sum(dim=1).float().mean().item())
    assert not torch.equal((q != 0).sum(dim=1), torch.full((len(q),), q.shape[1]))  # rows are sparse


WORDS = "man woman people dog cat train table street car room plate food bus red blue white black two".split()
STOCK_KEYS = ("ndcg@10", "mrr@10", "map@100", "recall@10", "recall@100", "precision@1", "accuracy@3")


@pytest.fixture(scope="module")
def beir(tmp_path_factory):
    """A BEIR folder: 40 documents, 12 queries with one or two relevant documents each (binary qrels, so
    the graded NDCG and MAP are the library's)."""
    folder = tmp_path_factory.mktemp("beir")
    docs = {f"d{i}": " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(3 + i % 9)) for i in range(40)}
    queries = {f"q{i}": " ".join(WORDS[(i * 5 + k * 3) % len(WORDS)] for k in range(2 + i % 3)) for i in range(12)}
    (folder / "corpus.jsonl").write_text(
        "".join(json.dumps({"_id": k, "title": "", "text": v}) + "\n" for k, v in docs.items())
    )
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": k, "text": v}) + "\n" for k, v in queries.items()))
    (folder / "qrels").mkdir()
    lines = ["query-id\tcorpus-id\tscore"] + [f"q{i}\td{i}\t1" for i in range(12)]
    lines += [f"q{i}\td{i + 20}\t1" for i in range(0, 12, 3)]
    (folder / "qrels" / "test.tsv").write_text("\n".join(lines) + "\n")
    return folder


def test_metrics_equal_the_stock_sparse_evaluator_and_the_csr_cache_reads_back(model, beir, tmp_path):
    from sentence_transformers.sparse_encoder.evaluation import SparseInformationRetrievalEvaluator

    rs = load_beir(beir)
    stock = SparseInformationRetrievalEvaluator(
        rs.queries, rs.corpus, rs.relevant_docs, name=rs.name, precision_recall_at_k=[1, 3, 5, 10, 100]
    )(model)
    ours, corpus = evaluate_retrieval(model, rs, cache_dir=tmp_path)
    assert not corpus.cache_hit and corpus.cache_file.endswith(".csr.npz") and corpus.indices is not None
    for key in STOCK_KEYS:
        assert ours[f"{rs.name}_dot_{key}"] == pytest.approx(stock[f"{rs.name}_dot_{key}"], abs=1e-6), key
    for key in ("query_active_dims", "corpus_active_dims", "avg_flops"):
        assert ours[f"{rs.name}_{key}"] == pytest.approx(stock[f"{rs.name}_{key}"], rel=1e-6), key
    assert 0 < ours[f"{rs.name}_corpus_active_dims"] < 127 and ours[f"{rs.name}_dot_ndcg@10"] > 0
    # the CSR file holds each document's active coordinates and values: the model's own sparse vectors
    dense = model.encode_document(list(rs.corpus.values()), convert_to_tensor=True).to_dense()
    stored = corpus.on_device("cpu").to_dense()
    assert corpus.indices.dtype == np.int32 and len(corpus.indices) == int((dense != 0).sum())
    torch.testing.assert_close(stored, dense, rtol=0, atol=1e-6)
    again, corpus = evaluate_retrieval(model, rs, cache_dir=tmp_path)
    assert corpus.cache_hit and again == ours  # the CSR cache reads back to the same scores


def test_cembed_eval_scores_a_sparse_folder_by_dot_product_with_active_dims(model, beir, tmp_path):
    model.save(str(tmp_path / "saved"))
    report = score_model(str(tmp_path / "saved"), [beir], [], device="cpu", cache_dir=tmp_path / "cache")
    entry = report.sets[load_beir(beir).name]
    head = entry["headline"]
    assert list(head) == [
        "NDCG@10", "MRR@10", "MAP@100", "Recall@10", "Recall@100", "active dims (queries)", "active dims (documents)"
    ]  # fmt: skip
    assert head["NDCG@10"] == entry["metrics"][f"{load_beir(beir).name}_dot_ndcg@10"] > 0
    with pytest.raises(UserError, match=r"^--sts: .* scores a query and a document by dot, not one vector per text"):
        score_model(str(tmp_path / "saved"), [], [STS_TEST], device="cpu")
    with pytest.raises(UserError, match=r"^--dims: .* is not a dense model \(it scores by dot\)"):
        score_dims(str(tmp_path / "saved"), [beir], [], [8], device="cpu")


def test_a_second_cembed_eval_of_a_splade_folder_reads_its_corpus_from_the_csr_cache(beir, tmp_path):
    """A SPLADE folder saved before any forward (its ``SpladePooling`` config has no ``embedding_dimension``, so
    sentence-transformers' ``get_embedding_dimension`` answers the hidden size until a forward): each ``cembed
    eval`` loads it afresh, and the second run reads the first run's CSR file (vocabulary-wide rows) instead of
    encoding the corpus again, to the same metrics."""
    make_tiny_splade(tmp_path / "src", bias=-0.1).save(str(tmp_path / "saved"))
    name = load_beir(beir).name
    first = score_model(str(tmp_path / "saved"), [beir], [], device="cpu", cache_dir=tmp_path / "cache").sets[name]
    second = score_model(str(tmp_path / "saved"), [beir], [], device="cpu", cache_dir=tmp_path / "cache").sets[name]
    assert not first["corpus_cache_hit"] and first["corpus_cache"].endswith(".csr.npz")
    assert second["corpus_cache_hit"] and second["corpus_cache"] == first["corpus_cache"]
    assert second["encode_seconds"] == 0 and second["metrics"] == first["metrics"]


@pytest.fixture(scope="module")
def cosine_folder(tmp_path_factory):
    """A SPLADE ``SparseEncoder`` folder saved with ``similarity_fn_name: cosine`` (as some published sparse
    models are), and its files."""
    root = tmp_path_factory.mktemp("cosine_splade")
    splade = make_tiny_splade(root / "src", bias=-0.1, seed=3)
    splade.similarity_fn_name = "cosine"
    splade.save(str(root / "model"))
    return root / "model"


def _stock(folder, rs, similarity: str | None = None):
    """Plain sentence-transformers' ``SparseInformationRetrievalEvaluator`` on the folder as
    ``SparseEncoder(folder)`` loads it; ``similarity`` replaces the folder's own."""
    from sentence_transformers.sparse_encoder import SparseEncoder
    from sentence_transformers.sparse_encoder.evaluation import SparseInformationRetrievalEvaluator

    plain = SparseEncoder(str(folder), device="cpu")
    if similarity is not None:
        plain.similarity_fn_name = similarity
    evaluator = SparseInformationRetrievalEvaluator(
        rs.queries, rs.corpus, rs.relevant_docs, name=rs.name, precision_recall_at_k=[1, 3, 5, 10, 100]
    )
    return plain, evaluator(plain)


def test_cembed_eval_scores_a_cosine_sparse_folder_by_cosine_as_sentence_transformers_does(
    cosine_folder, beir, tmp_path
):
    """A folder whose ``similarity_fn_name`` is cosine: ``cembed eval`` ranks by the model's own similarity,
    as plain sentence-transformers' ``SparseInformationRetrievalEvaluator`` (``model.similarity``) does on the
    same folder: every metric equal, keyed ``<set>_cosine_*``, the headline the cosine NDCG@10; the folder
    scored by dot product instead ranks differently (so a dot-product eval fails here)."""
    rs = load_beir(beir)
    plain, stock = _stock(cosine_folder, rs)
    assert plain.similarity_fn_name == "cosine"
    _, dot = _stock(cosine_folder, rs, similarity="dot")
    assert stock[f"{rs.name}_cosine_ndcg@10"] != pytest.approx(dot[f"{rs.name}_dot_ndcg@10"], abs=1e-3)
    report = score_model(str(cosine_folder), [beir], [], device="cpu", cache_dir=tmp_path / "cache")
    ours = report.sets[rs.name]["metrics"]
    for key in STOCK_KEYS:
        assert ours[f"{rs.name}_cosine_{key}"] == pytest.approx(stock[f"{rs.name}_cosine_{key}"], abs=1e-6), key
    for key in ("query_active_dims", "corpus_active_dims"):
        assert ours[f"{rs.name}_{key}"] == pytest.approx(stock[f"{rs.name}_{key}"], rel=1e-6), key
    assert not any("_dot_" in key for key in ours)
    assert report.sets[rs.name]["headline"]["NDCG@10"] == ours[f"{rs.name}_cosine_ndcg@10"]


def test_the_sparse_evaluator_scores_each_model_by_its_own_similarity(cosine_folder, beir):
    """The retrieval evaluator of the sparse kind (``similarity="dot"``: what evaluation during training
    builds once and calls on the model) scores a model by that model's similarity: a cosine model as plain
    sentence-transformers' evaluator does, then the same model set to dot by dot product."""
    from cembed.eval.evaluators import retrieval_evaluator

    rs = load_beir(beir)
    plain, stock = _stock(cosine_folder, rs)
    evaluator = retrieval_evaluator(rs, similarity="dot")
    ours = evaluator(plain)
    for key in ("ndcg@10", "mrr@10", "map@100", "recall@10"):
        assert ours[f"{rs.name}_cosine_{key}"] == pytest.approx(stock[f"{rs.name}_cosine_{key}"], abs=1e-6), key
    _, dot = _stock(cosine_folder, rs, similarity="dot")
    plain.similarity_fn_name = "dot"
    ours = evaluator(plain)
    assert ours[f"{rs.name}_dot_ndcg@10"] == pytest.approx(dot[f"{rs.name}_dot_ndcg@10"], abs=1e-6)
    assert not any("_cosine_" in key for key in ours)


def test_a_folder_with_another_max_active_dims_does_not_read_the_others_corpus_cache(beir, tmp_path):
    """Two folders that differ only in ``max_active_dims: 3`` in ``config_sentence_transformers.json`` (encode keeps
    each vector's 3 largest coordinates; a copy whose config was edited): ``cembed eval`` of the capped one after
    the uncapped one, with one cache, encodes its corpus capped (its own cache entry), so its metrics and active
    dimensions are plain sentence-transformers' on that folder, not the uncapped corpus's."""
    import shutil

    make_tiny_splade(tmp_path / "src", bias=-0.1).save(str(tmp_path / "uncapped"))
    shutil.copytree(tmp_path / "uncapped", tmp_path / "capped")
    config = tmp_path / "capped" / "config_sentence_transformers.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "max_active_dims": 3}))
    rs = load_beir(beir)
    _, stock = _stock(tmp_path / "capped", rs)
    uncapped = score_model(str(tmp_path / "uncapped"), [beir], [], device="cpu", cache_dir=tmp_path / "cache")
    capped = score_model(str(tmp_path / "capped"), [beir], [], device="cpu", cache_dir=tmp_path / "cache")
    first, second = uncapped.sets[rs.name], capped.sets[rs.name]
    assert first["metrics"][f"{rs.name}_corpus_active_dims"] > 3
    assert not second["corpus_cache_hit"] and second["corpus_cache"] != first["corpus_cache"]
    for key in ("dot_ndcg@10", "dot_mrr@10", "query_active_dims", "corpus_active_dims"):
        assert second["metrics"][f"{rs.name}_{key}"] == pytest.approx(stock[f"{rs.name}_{key}"], abs=1e-6), key
    assert second["metrics"][f"{rs.name}_corpus_active_dims"] <= 3
