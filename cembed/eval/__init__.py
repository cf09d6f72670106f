"""Scoring a model: the evaluation sets (BEIR retrieval, STS), the evaluators with graded NDCG, the
corpus-embedding cache, and ``cembed eval`` (with and without ``--dims``).

May import: ``cembed.data`` (the BEIR readers), ``cembed.model``, ``cembed.plan``, ``cembed.config``,
``cembed.files``, ``cembed.errors`` (never a loss, the probe, train or cli).
"""
