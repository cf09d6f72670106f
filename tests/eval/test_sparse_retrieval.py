"""Exact dot-product retrieval of a sparse model (issue 41 item 3): the evaluator's NDCG@10 (graded) and MRR@10
are those of ranking every document by the dot product of the model's own sparse query and document
embeddings, and it reports the queries' and the documents' mean active dimensions."""

from __future__ import annotations

import pytest
import torch
from conftest import TEXTS, make_tiny_splade

from cembed.eval.metrics import graded_ndcg_at_k
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
