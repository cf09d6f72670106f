"""Retrieval metrics as MTEB computes them (pytrec_eval), on top of sentence-transformers' evaluator.

sentence-transformers' ``InformationRetrievalEvaluator`` scores NDCG with binary relevance: every
judged document counts 1, whatever its qrels grade. MTEB scores retrieval with pytrec_eval (trec_eval's
``ndcg_cut``), whose gain is the grade itself (Järvelin & Kekäläinen 2002, "Cumulated gain-based
evaluation of IR techniques", with the linear gain trec_eval uses): on a set with graded qrels
(TREC-COVID, NFCorpus: 2 = highly relevant, 1 = relevant) the two differ. :class:`GradedIREvaluator`
keeps the library's ranking, tie-breaking, metric names and every other metric, and recomputes

* NDCG@k with graded gain: ``DCG = sum_i grade(doc_i) / log2(i + 1)`` over the top k (i from 1), divided
  by the DCG of the judged grades sorted best first (the ideal ranking: every judged document, retrieved
  or not, cut at k), as pytrec_eval does;
* MAP@k as pytrec_eval's ``map_cut_k``: the precisions at the relevant documents in the top k divided
  by the number of relevant documents (the library divides by ``min(k, relevant)``, which differs only
  for a query with more than k relevant documents).

With binary qrels (every grade 1, as SciFact's) both are the library's numbers, bit for bit.
"""

from __future__ import annotations

from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator


def dcg_at_k(gains: list[float], k: int) -> float:
    """Discounted cumulated gain of the first ``k`` gains in rank order: ``sum gain_i / log2(i + 2)``
    for i from 0 (Järvelin & Kekäläinen 2002; trec_eval / pytrec_eval ``ndcg_cut`` use the linear gain)."""
    return InformationRetrievalEvaluator.compute_dcg_at_k(gains, k)


def graded_ndcg_at_k(ranked_ids: list[str], grades: dict[str, int], k: int) -> float:
    """NDCG@k of one query as pytrec_eval computes it: the DCG of the ranking's grades (a document
    without a positive grade gains 0) over the DCG of all positive grades sorted best first, cut at
    ``k`` (the ideal counts the judged documents ranked below ``k`` or not retrieved at all).

    Args:
        ranked_ids: document ids, best first. grades: document id -> qrels grade.
    """
    gains = [max(grades.get(doc, 0), 0) for doc in ranked_ids[:k]]
    ideal = sorted((g for g in grades.values() if g > 0), reverse=True)
    best = dcg_at_k(ideal, k)
    return dcg_at_k(gains, k) / best if best > 0 else 0.0


def average_precision_at_k(ranked_ids: list[str], relevant: set[str], k: int) -> float:
    """pytrec_eval's ``map_cut_k`` for one query: the precision at each relevant document in the top
    ``k``, summed and divided by the number of relevant documents."""
    hits, total = 0, 0.0
    for rank, doc in enumerate(ranked_ids[:k], 1):
        if doc in relevant:
            hits += 1
            total += hits / rank
    return total / len(relevant) if relevant else 0.0


class GradedIREvaluator(InformationRetrievalEvaluator):
    """``InformationRetrievalEvaluator`` whose NDCG@k uses the qrels grades and whose MAP@k divides
    by the number of relevant documents, as MTEB (pytrec_eval) computes them; the other metrics, the
    ranking and the metric keys (``<name>_cosine_ndcg@10``, ...) are the library's.

    Args:
        *args, **kwargs: as for ``InformationRetrievalEvaluator``.
        relevance: query id -> {document id -> grade > 0}; None or a query left out: every document
            in ``relevant_docs`` has grade 1 (binary NDCG).
    """

    def __init__(self, *args, relevance: dict[str, dict[str, int]] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.relevance = relevance or {}

    def _model_score_functions(self, model) -> dict:
        """The library's per-call similarity (``{model.similarity_fn_name: model.similarity}``, used when no
        ``score_functions`` are given), or cosine for a model without one (any object whose ``encode_query`` /
        ``encode_document`` give one vector per text)."""
        if hasattr(model, "similarity"):
            return super()._model_score_functions(model)
        from sentence_transformers.util import cos_sim

        return {"cosine": cos_sim}

    def grades(self, query_id: str) -> dict[str, int]:
        """The grades of ``query_id``'s relevant documents (1 for those without one)."""
        graded = self.relevance.get(query_id, {})
        return {doc: graded.get(doc, 1) for doc in self.relevant_docs[query_id]}

    def compute_metrics(self, queries_result_list: list[object]):
        """The library's metrics, with NDCG@k and MAP@k replaced as described in the class docstring."""
        import numpy as np

        scores = super().compute_metrics(queries_result_list)
        ndcg: dict[int, list[float]] = {k: [] for k in self.ndcg_at_k}
        ap: dict[int, list[float]] = {k: [] for k in self.map_at_k}
        for query_itr, hits in enumerate(queries_result_list):
            query_id = self.queries_ids[query_itr]
            # The library's final order: descending score, ties by ascending corpus id.
            ranked = [h["corpus_id"] for h in sorted(hits, key=lambda x: (-x["score"], x["corpus_id"]))]
            grades = self.grades(query_id)
            for k in self.ndcg_at_k:
                ndcg[k].append(graded_ndcg_at_k(ranked, grades, k))
            for k in self.map_at_k:
                ap[k].append(average_precision_at_k(ranked, set(grades), k))
        scores["ndcg@k"] = {k: np.mean(v) for k, v in ndcg.items()}
        scores["map@k"] = {k: np.mean(v) for k, v in ap.items()}
        return scores
