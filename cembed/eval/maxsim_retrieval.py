"""Exact MaxSim retrieval for a multi-vector model (``model.kind: multi_vector``): every query against every
document by brute force, scored in tiles (:func:`cembed.model.maxsim.maxsim_scores`) over ragged token
vectors, with the library's metrics and graded NDCG (:class:`cembed.eval.metrics.GradedIREvaluator`).

Queries are encoded with ``encode_query`` and documents with ``encode_document`` (each a list of
``(tokens, dim)`` tensors: the scored tokens only, no padding); the evaluator scores the queries against
one corpus chunk at a time and keeps each query's top documents, as sentence-transformers'
``InformationRetrievalEvaluator`` does. Its metric keys are ``<name>_maxsim_<metric>@<k>`` (under
MeanMaxSim, a query's scores are divided by its token count: the ranking, and so every metric, is
MaxSim's).
"""

from __future__ import annotations

from cembed.eval.metrics import GradedIREvaluator
from cembed.model.maxsim import RaggedTokens, Tiles, maxsim_scores

SIMILARITY = "maxsim"


def ragged(embeddings) -> RaggedTokens:
    """A list of ``(tokens, dim)`` tensors (or arrays) as :class:`RaggedTokens`."""
    import torch

    rows = [torch.as_tensor(e) for e in embeddings]
    values = torch.cat(rows) if rows else torch.zeros(0, 1)
    return RaggedTokens.from_lengths(values, [len(r) for r in rows])


class MaxSimIREvaluator(GradedIREvaluator):
    """:class:`GradedIREvaluator` by MaxSim over ragged token vectors, scored in ``tiles``.

    Args:
        *args, **kwargs: as for ``GradedIREvaluator`` (its score functions are this class's).
        tiles: the MaxSim tiles (memory only; the scores are exact).
    """

    def __init__(self, *args, tiles: Tiles = Tiles(), **kwargs) -> None:
        self.tiles = tiles
        super().__init__(*args, score_functions={SIMILARITY: self.scores}, main_score_function=SIMILARITY, **kwargs)

    def scores(self, queries, documents):
        """``(queries, documents)`` MaxSim scores of two lists of token-vector tensors."""
        q, d = ragged(queries), ragged(documents)
        return maxsim_scores(q, RaggedTokens(d.values.to(q.values.device, q.values.dtype), d.offsets), self.tiles)

    def embed_inputs(self, model, sentences, encode_fn_name=None, prompt_name=None, prompt=None, **kwargs):
        """The texts' scored token vectors, a list of ``(tokens, dim)`` tensors (queries with
        ``encode_query``, documents with ``encode_document``)."""
        encode = {"query": model.encode_query, "document": model.encode_document}.get(encode_fn_name, model.encode)
        return encode(
            list(sentences),
            prompt_name=prompt_name,
            prompt=prompt,
            batch_size=self.batch_size,
            show_progress_bar=self.show_progress_bar,
        )
