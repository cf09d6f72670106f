"""Evaluation the way MTEB measures it: BEIR retrieval sets and STS pairs, scored by
sentence-transformers' own evaluators.

* Retrieval: :class:`~cembed.eval.metrics.GradedIREvaluator` (sentence-transformers' evaluator, NDCG graded
  as pytrec_eval) with the similarity of the model's kind (``ModelConfig.similarity``): a dense model's
  own (cosine, as cembed trains it; the dot product or distance a folder saved with one is evaluated by),
  MaxSim in tiles for a multi-vector one (:mod:`cembed.eval.maxsim_retrieval`), sparse vectors
  by the model's own similarity for a sparse one (:mod:`cembed.eval.sparse_retrieval`: the dot product, or
  the cosine a folder is saved with; it also reports the mean active dimensions of queries and documents);
  one factory per kind's similarity in :data:`RETRIEVAL_EVALUATORS`: NDCG@10, MRR@10, MAP@100, Recall@10,
  Recall@100 and others. Metric keys name the similarity the model was scored by (:func:`scored_by`).
* STS: :class:`~sentence_transformers.sentence_transformer.evaluation.EmbeddingSimilarityEvaluator`; the
  headline is the Spearman correlation of cosine similarity with the gold scores (MTEB's STS main score).

No metric is computed here: sets come from :mod:`cembed.eval.sets`, corpus embeddings from
:mod:`cembed.eval.embedding_cache`, both go to those evaluators (graded NDCG: :mod:`cembed.eval.metrics`). Nothing
here prints (``cembed eval``: :mod:`cembed.eval.score`; evaluation during training, built from these
evaluators: :mod:`cembed.train.evaluation`).
"""

from __future__ import annotations

from pathlib import Path

from cembed.eval.embedding_cache import CorpusEmbeddings, ProgressFn, corpus_embeddings
from cembed.eval.sets import RetrievalSet, StsSet

# The metrics shown for each kind of set: (label, key suffix in the evaluator's output).
RETRIEVAL_HEADLINE = (
    ("NDCG@10", "cosine_ndcg@10"),
    ("MRR@10", "cosine_mrr@10"),
    ("MAP@100", "cosine_map@100"),
    ("Recall@10", "cosine_recall@10"),
    ("Recall@100", "cosine_recall@100"),
)
STS_HEADLINE = (("Spearman (cosine)", "spearman_cosine"), ("Pearson (cosine)", "pearson_cosine"))
# Shown after a retrieval set's headline where its evaluator reports them (a sparse model's: the mean
# non-zero coordinates of a query's and of a document's vector).
ACTIVE_DIMS = (("active dims (queries)", "query_active_dims"), ("active dims (documents)", "corpus_active_dims"))


def retrieval_headline(similarity: str = "cosine") -> tuple[tuple[str, str], ...]:
    """:data:`RETRIEVAL_HEADLINE` for the metric keys of ``similarity`` (``maxsim_ndcg@10``, ...)."""
    return tuple((label, suffix.replace("cosine_", f"{similarity}_", 1)) for label, suffix in RETRIEVAL_HEADLINE)


def _ir_arguments(rs: RetrievalSet, batch_size: int, write_csv: bool, prompts) -> dict:
    """The evaluator arguments every similarity shares: the set, the metrics, the prompts."""
    return dict(
        queries=rs.queries,
        corpus=rs.corpus,
        relevant_docs=rs.relevant_docs,
        relevance=rs.relevance,
        mrr_at_k=[10],
        ndcg_at_k=[10],
        accuracy_at_k=[1, 3, 5, 10],
        precision_recall_at_k=[1, 3, 5, 10, 100],
        map_at_k=[100],
        batch_size=batch_size,
        name=rs.name,
        write_csv=write_csv,
        query_prompt=prompts.anchor if prompts else None,
        corpus_prompt=prompts.positive if prompts else None,
    )


def _maxsim_evaluator(rs: RetrievalSet, batch_size: int = 32, write_csv: bool = False, prompts=None):
    from cembed.eval.maxsim_retrieval import MaxSimIREvaluator

    return MaxSimIREvaluator(**_ir_arguments(rs, batch_size, write_csv, prompts))


def retrieval_evaluator(
    rs: RetrievalSet, batch_size: int = 32, write_csv: bool = False, prompts=None, similarity: str = "cosine"
):
    """A :class:`~cembed.eval.metrics.GradedIREvaluator` for ``rs`` with ``similarity`` (the model kind's:
    ``cosine``, a dense model's, which scores each model by its own ``similarity_fn_name``, cosine unless a
    folder is saved with another; or a similarity of :data:`RETRIEVAL_EVALUATORS`), metrics
    Accuracy/Precision/Recall@{1,3,5,10,100}, MRR@10, NDCG@10 (graded by ``rs.relevance``) and MAP@100. Its
    metric keys are ``<rs.name>_<scored by>_<metric>@<k>`` (:func:`scored_by`); its primary metric
    ``<rs.name>_<scored by>_ndcg@10``.
    ``prompts`` (:class:`cembed.model.prompts.RolePrompts`): queries get the anchor's prompt, the corpus
    the positive's (None: the model's ``encode_query`` / ``encode_document`` defaults).

    Raises:
        ValueError: no evaluator for ``similarity``.
    """
    if similarity != "cosine":
        factory = RETRIEVAL_EVALUATORS.get(similarity)
        if factory is None:
            raise ValueError(
                f"no retrieval evaluator for similarity {similarity!r}; known: cosine, {', '.join(RETRIEVAL_EVALUATORS)}"
            )
        return factory(rs, batch_size, write_csv, prompts)
    from cembed.eval.metrics import GradedIREvaluator  # imports sentence-transformers

    # No score_functions: the library scores each model it is called on by that model's own similarity
    # (``model.similarity``, named by ``model.similarity_fn_name``): cosine for a model cembed trains (the
    # dense kind's prepare_training), the dot product a folder saved with it is evaluated by.
    return GradedIREvaluator(**_ir_arguments(rs, batch_size, write_csv, prompts))


def _sparse_evaluator(rs: RetrievalSet, batch_size: int = 32, write_csv: bool = False, prompts=None):
    from cembed.eval.sparse_retrieval import SparseIREvaluator

    return SparseIREvaluator(**_ir_arguments(rs, batch_size, write_csv, prompts))


# similarity name (a model kind's ModelConfig.similarity) -> the factory of its retrieval evaluator, called
# as factory(rs, batch_size, write_csv, prompts); cosine is retrieval_evaluator's own.
RETRIEVAL_EVALUATORS = {"maxsim": _maxsim_evaluator, "dot": _sparse_evaluator}


def sts_evaluator(sts: StsSet, batch_size: int = 32, write_csv: bool = False):
    """An ``EmbeddingSimilarityEvaluator`` on cosine similarity; keys ``<sts.name>_spearman_cosine``
    (primary) and ``<sts.name>_pearson_cosine``."""
    from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator

    return EmbeddingSimilarityEvaluator(
        sts.sentences1,
        sts.sentences2,
        sts.scores,
        batch_size=batch_size,
        main_similarity="cosine",
        similarity_fn_names=["cosine"],
        name=sts.name,
        write_csv=write_csv,
    )


def evaluate_retrieval(
    model,
    rs: RetrievalSet,
    batch_size: int = 32,
    cache_dir: str | Path | None = None,
    progress: ProgressFn | None = None,
    model_fp: str | None = None,
    prompts=None,
) -> tuple[dict[str, float], CorpusEmbeddings]:
    """Score ``model`` on ``rs``: corpus embeddings from the cache (or encoded), queries encoded by
    the evaluator, metrics by ``InformationRetrievalEvaluator``; ``prompts`` as in :func:`retrieval_evaluator`.

    Returns:
        ``(metrics, corpus_embeddings)``; metrics keyed ``<rs.name>_<similarity>_<metric>@<k>``
        (:func:`scored_by` the model).
    """
    prompt = prompts.positive if prompts else None
    ce = corpus_embeddings(model, rs.corpus, batch_size, cache_dir, progress, model_fp, prompt)
    evaluator = retrieval_evaluator(rs, batch_size, prompts=prompts, similarity=similarity_of(model))
    metrics = evaluator(model, corpus_embeddings=ce.on_device(model.device))
    return {k: float(v) for k, v in metrics.items()}, ce


def similarity_of(model) -> str:
    """The similarity of ``model``'s kind (``ModelConfig.similarity``), which picks its retrieval evaluator
    (:data:`RETRIEVAL_EVALUATORS`); cosine for a model of no registered kind (any object with
    ``encode_query`` / ``encode_document`` giving one vector)."""
    from cembed.model.kinds.lookup import kind_of

    return kind_of(model, default="dense").config_class.similarity


def scored_by(model) -> str:
    """The similarity the loaded ``model`` scores by, which names its retrieval metrics
    (``<set>_<name>_ndcg@10``): its kind's answer (:meth:`cembed.model.kinds.registry.ModelKind.similarity_name`;
    a sparse model's own ``similarity_fn_name``); cosine for a model of no registered kind."""
    from cembed.model.kinds.lookup import kind_of

    return kind_of(model, default="dense").similarity_name(model)


def evaluate_sts(model, sts: StsSet, batch_size: int = 32) -> dict[str, float]:
    """Score ``model`` on ``sts`` with ``EmbeddingSimilarityEvaluator``; keys ``<name>_spearman_cosine`` etc."""
    metrics = sts_evaluator(sts, batch_size)(model)
    return {k: float(v) for k, v in metrics.items()}


def headline(metrics: dict[str, float], name: str, kind: str, similarity: str = "cosine") -> dict[str, float]:
    """The few metrics shown for a set: label -> value (``kind`` is ``retrieval`` or ``sts``; ``similarity``
    the retrieval metrics' score, :func:`retrieval_headline`), with the :data:`ACTIVE_DIMS` where the
    evaluator measured them."""
    rows = (*retrieval_headline(similarity), *ACTIVE_DIMS) if kind == "retrieval" else STS_HEADLINE
    return {label: metrics[f"{name}_{suffix}"] for label, suffix in rows if f"{name}_{suffix}" in metrics}
