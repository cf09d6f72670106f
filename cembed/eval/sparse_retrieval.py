"""Exact dot-product retrieval for a sparse model (``model.kind: sparse``): every query against every document
of the corpus (sentence-transformers' ``SparseInformationRetrievalEvaluator``: sparse embeddings, dot
product, the top documents of each query kept chunk by chunk), with cembed's graded NDCG and MAP
(:class:`cembed.eval.metrics.GradedIREvaluator`) and the mean active dimensions of the queries and of the
documents. Queries are encoded with ``encode_query``, documents with ``encode_document`` (an inference-free
model's static query side, its SPLADE document side). Metric keys: ``<name>_dot_<metric>@<k>`` and
``<name>_query_active_dims`` / ``<name>_corpus_active_dims`` (also ``..._sparsity_ratio``, ``avg_flops``).
"""

from __future__ import annotations

from sentence_transformers.sparse_encoder.evaluation import SparseInformationRetrievalEvaluator

from cembed.eval.metrics import GradedIREvaluator

SIMILARITY = "dot"


class SparseIREvaluator(GradedIREvaluator, SparseInformationRetrievalEvaluator):
    """``SparseInformationRetrievalEvaluator`` scored by dot product, with graded NDCG and MAP.

    Args:
        *args, **kwargs: as for ``GradedIREvaluator`` / ``SparseInformationRetrievalEvaluator`` (the score
            function is the dot product, whatever the model's own similarity: what the sparse loss trains).
    """

    def __init__(self, *args, **kwargs) -> None:
        from sentence_transformers.util import dot_score

        kwargs.pop("score_functions", None)
        super().__init__(*args, score_functions={SIMILARITY: dot_score}, main_score_function=SIMILARITY, **kwargs)
