"""Retrieval metrics as MTEB (pytrec_eval) computes them: graded NDCG, MAP over all relevant
documents, everything else the library's, against hand computations."""

from __future__ import annotations

import json
import math

import pytest
import torch

from cembed.eval.evaluators import evaluate_retrieval, retrieval_evaluator
from cembed.eval.metrics import GradedIREvaluator, graded_ndcg_at_k
from cembed.eval.sets import load_beir

# 8 documents (one-hot vectors), 3 queries; each query's vector weights the documents 8, 7, ..., 1 in
# its ranking order, so cosine similarity ranks them exactly so.
DOCS = [f"d{i}" for i in range(1, 9)]
RANKING = {
    "q1": ["d1", "d2", "d3", "d4", "d5", "d6", "d7", "d8"],
    "q2": ["d3", "d5", "d7", "d1", "d2", "d4", "d6", "d8"],
    "q3": ["d8", "d7", "d6", "d5", "d4", "d3", "d2", "d1"],
}
# qrels grades (2 = highly relevant, 1 = relevant, 0 = judged not relevant), as TREC-COVID / NFCorpus:
GRADES = {
    "q1": {"d1": 2, "d8": 1, "d2": 0},  # relevant at ranks 1 (grade 2) and 8 (grade 1)
    "q2": {"d3": 1, "d5": 2, "d7": 1},  # ranks 1, 2, 3: grades 1, 2, 1
    "q3": {"d8": 1, "d6": 2, "d1": 1},  # ranks 1, 3, 8: grades 1, 2, 1
}


class RankingModel:
    """Stands in for a SentenceTransformer: documents are one-hot, queries weight them by RANKING."""

    device = torch.device("cpu")
    similarity_fn_name = "cosine"

    class model_card_data:  # noqa: N801 - mimics the attribute the evaluators write to
        @staticmethod
        def set_evaluation_metrics(*args, **kwargs):
            pass

    def encode(self, texts, convert_to_tensor=False, **kwargs):
        rows = []
        for text in texts:
            vec = [0.0] * len(DOCS)
            if text in RANKING:
                for rank, doc in enumerate(RANKING[text]):
                    vec[DOCS.index(doc)] = float(len(DOCS) - rank)
            else:
                vec[DOCS.index(text)] = 1.0
            rows.append(vec)
        emb = torch.tensor(rows)
        return emb if convert_to_tensor else emb.numpy()

    encode_query = encode
    encode_document = encode


def write_graded_beir(root, grades=GRADES):
    root.mkdir(parents=True, exist_ok=True)
    (root / "corpus.jsonl").write_text("".join(json.dumps({"_id": d, "title": "", "text": d}) + "\n" for d in DOCS))
    (root / "queries.jsonl").write_text("".join(json.dumps({"_id": q, "text": q}) + "\n" for q in RANKING))
    (root / "qrels").mkdir(exist_ok=True)
    rows = ["query-id\tcorpus-id\tscore"] + [f"{q}\t{d}\t{g}" for q, gs in grades.items() for d, g in gs.items()]
    (root / "qrels" / "test.tsv").write_text("\n".join(rows) + "\n")
    return root


def log2(x):
    return math.log2(x)


# By hand (Järvelin & Kekäläinen 2002 with trec_eval's linear gain: DCG = sum gain_i / log2(i + 1)):
BINARY = (
    (1 + 1 / log2(9)) / (1 + 1 / log2(3))  # q1: 0.806574
    + 1.0  # q2: the 3 relevant documents fill ranks 1-3
    + (1 + 1 / log2(4) + 1 / log2(9)) / (1 + 1 / log2(3) + 1 / log2(4))  # q3: 0.851959
) / 3
GRADED = (
    (2 + 1 / log2(9)) / (2 + 1 / log2(3))  # q1: 0.880094
    + (1 + 2 / log2(3) + 1 / log2(4)) / (2 + 1 / log2(3) + 1 / log2(4))  # q2: 0.882121
    + (1 + 2 / log2(4) + 1 / log2(9)) / (2 + 1 / log2(3) + 1 / log2(4))  # q3: 0.739545
) / 3


def library_evaluator(rs):
    """sentence-transformers' own evaluator, binary NDCG: what `cembed eval` used before."""
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator
    from sentence_transformers.util import cos_sim

    ev = retrieval_evaluator(rs)
    kwargs = {k: getattr(ev, k) for k in ("mrr_at_k", "ndcg_at_k", "accuracy_at_k", "precision_recall_at_k")}
    return InformationRetrievalEvaluator(
        rs.queries, rs.corpus, rs.relevant_docs, map_at_k=ev.map_at_k, name=rs.name, write_csv=False,
        score_functions={"cosine": cos_sim}, main_score_function="cosine", **kwargs,
    )  # fmt: skip


def test_hand_values():
    assert round(BINARY, 6) == 0.886178
    assert round(GRADED, 6) == 0.833920


def test_loader_keeps_grades(tmp_path):
    rs = load_beir(write_graded_beir(tmp_path / "graded"), "test")
    assert rs.relevance == {q: {d: g for d, g in gs.items() if g > 0} for q, gs in GRADES.items()}
    assert rs.relevant_docs == {q: set(gs) for q, gs in rs.relevance.items()}


def test_graded_ndcg_matches_hand_computation_and_other_metrics_are_the_librarys(tmp_path):
    rs = load_beir(write_graded_beir(tmp_path / "graded"), "test")
    metrics, _ = evaluate_retrieval(RankingModel(), rs, cache_dir=None)
    assert metrics["graded-test_cosine_ndcg@10"] == pytest.approx(GRADED, abs=1e-12)  # 0.833920
    before = library_evaluator(rs)(RankingModel())
    assert before["graded-test_cosine_ndcg@10"] == pytest.approx(BINARY, abs=1e-12)  # 0.886178: grades ignored
    assert set(before) == set(metrics)  # same keys
    for key, value in before.items():
        if "ndcg" not in key:  # MRR, MAP (fewer than 100 relevant), recall, precision, accuracy: unchanged
            assert metrics[key] == value, key
    # q1: 1/1, q2: 1/1, q3: 1/1 -> MRR 1; MAP by hand: q1 (1 + 2/8)/2, q2 1, q3 (1 + 2/3 + 3/8)/3
    assert metrics["graded-test_cosine_mrr@10"] == 1.0
    assert metrics["graded-test_cosine_map@100"] == pytest.approx(((1 + 2 / 8) / 2 + 1 + (1 + 2 / 3 + 3 / 8) / 3) / 3)


def test_binary_qrels_give_the_librarys_numbers_bit_for_bit(tmp_path):
    """SciFact's qrels are all 1: its numbers must not move."""
    ones = {q: {d: 1 for d, g in gs.items() if g > 0} for q, gs in GRADES.items()}
    rs = load_beir(write_graded_beir(tmp_path / "binary", ones), "test")
    metrics, _ = evaluate_retrieval(RankingModel(), rs, cache_dir=None)
    assert metrics == {k: float(v) for k, v in library_evaluator(rs)(RankingModel()).items()}
    assert metrics["binary-test_cosine_ndcg@10"] == pytest.approx(BINARY, abs=1e-12)


def test_map_divides_by_all_relevant_documents_as_pytrec_eval():
    """map_cut_100 with 120 relevant documents all ranked first: 100 precisions of 1 over 120
    relevant = 0.833333 (the library divides by min(100, 120) and gives 1.0)."""
    corpus = {f"d{i:03d}": f"d{i:03d}" for i in range(150)}
    relevant = {"q": set(list(corpus)[:120])}
    ev = GradedIREvaluator({"q": "q"}, corpus, relevant, map_at_k=[100], precision_recall_at_k=[100], write_csv=False)
    hits = [[{"corpus_id": d, "score": 1.0 - i / 1000} for i, d in enumerate(list(corpus)[:100])]]
    scores = ev.compute_metrics(hits)
    assert scores["map@k"][100] == pytest.approx(100 / 120)
    assert scores["ndcg@k"][10] == 1.0 and scores["recall@k"][100] == pytest.approx(100 / 120)


def test_graded_ndcg_edge_cases():
    assert graded_ndcg_at_k(["a", "b"], {"b": 3, "c": 0}, 10) == pytest.approx((3 / log2(3)) / 3)
    assert graded_ndcg_at_k(["a"], {"a": 0}, 10) == 0.0  # nothing relevant: 0, not a division by zero
    assert graded_ndcg_at_k(["x", "a"], {"a": 2, "b": 1}, 1) == 0.0  # cut at k


def test_graded_ndcg_ideal_counts_relevant_documents_outside_the_top_k():
    """The ideal DCG is over every judged grade (retrieved or not), cut at k; a ranking that leaves
    the best documents below k (or out of the retrieved list) must not be scored against its own hits.

    Grades a 3, b 2, c 1 (x, y, z unjudged); DCG gains are grade / log2(rank + 1).
    """
    grades = {"a": 3, "b": 2, "c": 1, "y": 0}
    # k = 3, ranking x c y | b a: only c (grade 1, rank 2) is in the top 3.
    #   DCG@3  = 1 / log2(3)                           = 0.630930
    #   IDCG@3 = 3 / log2(2) + 2 / log2(3) + 1 / log2(4) = 3 + 1.261860 + 0.5 = 4.761860
    #   NDCG@3 = 0.630930 / 4.761860                    = 0.132497
    # (an ideal from the top 3 alone, gains [1], gives 0.630930 / 1 = 0.630930)
    expected = (1 / log2(3)) / (3 + 2 / log2(3) + 1 / log2(4))
    assert round(expected, 6) == 0.132497
    assert graded_ndcg_at_k(["x", "c", "y", "b", "a"], grades, 3) == pytest.approx(expected, abs=1e-12)
    # a (grade 3) not retrieved at all: the same 0.132497 (an ideal from the retrieved c, b, gains
    # [2, 1], would give 0.630930 / (2 + 1 / log2(3)) = 0.239812).
    assert graded_ndcg_at_k(["x", "c", "y", "b"], grades, 3) == pytest.approx(expected, abs=1e-12)


def test_graded_ndcg_with_fewer_ranks_than_relevant_documents():
    """k = 2 < 4 relevant documents (a 3, b 2, c 1, d 1), ranking b x a c: the ideal is cut at k too.

    DCG@2  = 2 / log2(2) + 0 / log2(3)  = 2
    IDCG@2 = 3 / log2(2) + 2 / log2(3)  = 3 + 1.261860 = 4.261860
    NDCG@2 = 2 / 4.261860               = 0.469279
    (ideal not cut at k, + 1 / log2(4) + 1 / log2(5): 2 / 5.192537 = 0.385168; ideal from the top 2,
    gains [2, 0] sorted: 2 / 2 = 1.0; binary, as the library: (1 / 1) / (1 + 1 / log2(3)) = 0.613147)
    """
    grades = {"a": 3, "b": 2, "c": 1, "d": 1}
    expected = 2 / (3 + 2 / log2(3))
    assert round(expected, 6) == 0.469279
    assert graded_ndcg_at_k(["b", "x", "a", "c"], grades, 2) == pytest.approx(expected, abs=1e-12)


def test_evaluator_ndcg_when_relevant_documents_are_not_retrieved():
    """Through the evaluator: every k is 3, so it retrieves only each query's top 3 of the 8 documents
    and the relevant documents ranked below never reach the metric; the ideal still counts them.

    q1 ranks d1 d2 d3 | d4 ... d7 ...; grades d2 1, d4 2, d7 3 (3 relevant, 2 of them not retrieved):
      DCG@3 = 1 / log2(3) = 0.630930; IDCG@3 = 3 + 2 / log2(3) + 1 / log2(4) = 4.761860 -> 0.132497
    q2 ranks d3 d5 d7 | d1 d2 d4 d6 d8; grades d5 3, d1 2, d2 1, d8 1 (4 relevant > k = 3):
      DCG@3 = 3 / log2(3) = 1.892789; IDCG@3 = 3 + 2 / log2(3) + 1 / log2(4) = 4.761860 -> 0.397490
    mean 0.264993 (an ideal from the retrieved documents: (0.630930 / 1 + 1.892789 / 3) / 2 = 0.630930)
    """
    from sentence_transformers.util import cos_sim

    relevance = {"q1": {"d2": 1, "d4": 2, "d7": 3}, "q2": {"d5": 3, "d1": 2, "d2": 1, "d8": 1}}
    ev = GradedIREvaluator(
        {q: q for q in relevance}, {d: d for d in DOCS}, {q: set(g) for q, g in relevance.items()},
        relevance=relevance, mrr_at_k=[3], ndcg_at_k=[3], accuracy_at_k=[3], precision_recall_at_k=[3],
        map_at_k=[3], name="cut", write_csv=False, score_functions={"cosine": cos_sim}, main_score_function="cosine",
    )  # fmt: skip
    idcg = 3 + 2 / log2(3) + 1 / log2(4)
    expected = ((1 / log2(3)) / idcg + (3 / log2(3)) / idcg) / 2
    assert round(expected, 6) == 0.264993
    metrics = ev(RankingModel())
    assert metrics["cut_cosine_ndcg@3"] == pytest.approx(expected, abs=1e-12)
    assert metrics["cut_cosine_recall@3"] == pytest.approx((1 / 3 + 1 / 4) / 2)  # most relevant docs not retrieved
