"""Exact retrieval for a sparse model (``model.kind: sparse``): every query against every document of the
corpus (sentence-transformers' ``SparseInformationRetrievalEvaluator``: sparse embeddings, the top documents
of each query kept chunk by chunk), scored by the model's own similarity (``model.similarity``: the dot
product, or the cosine a folder may be saved with, as sentence-transformers scores it), with cembed's graded
NDCG and MAP (:class:`cembed.eval.metrics.GradedIREvaluator`) and the mean active dimensions of the queries
and of the documents. Queries are encoded with ``encode_query``, documents with ``encode_document`` (an
inference-free model's static query side, its SPLADE document side). Metric keys:
``<name>_<similarity>_<metric>@<k>`` (``<name>_dot_ndcg@10``) and ``<name>_query_active_dims`` /
``<name>_corpus_active_dims`` (also ``..._sparsity_ratio``, ``avg_flops``).
"""

from __future__ import annotations

from sentence_transformers.sparse_encoder.evaluation import SparseInformationRetrievalEvaluator

from cembed.eval.metrics import GradedIREvaluator


class SparseIREvaluator(GradedIREvaluator, SparseInformationRetrievalEvaluator):
    """``SparseInformationRetrievalEvaluator`` with graded NDCG and MAP. Without ``score_functions`` (as
    :mod:`cembed.eval.evaluators` builds it) it scores each model it is called on by that model's own
    similarity (the library's default, resolved per call from ``model.similarity_fn_name``), so a folder
    saved with cosine is ranked as sentence-transformers ranks it.

    Args:
        *args, **kwargs: as for ``GradedIREvaluator`` / ``SparseInformationRetrievalEvaluator``.
    """
