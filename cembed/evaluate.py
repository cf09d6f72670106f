"""Evaluation the way MTEB measures it: BEIR retrieval sets and STS pairs, scored by
sentence-transformers' own evaluators.

* Retrieval (BEIR layout: ``corpus.jsonl[.gz]``, ``queries.jsonl``, ``qrels/<split>.tsv``):
  :class:`~sentence_transformers.sentence_transformer.evaluation.InformationRetrievalEvaluator` with
  cosine similarity, reporting NDCG@10, MRR@10, MAP@100, Recall@10 and Recall@100 among others.
  Documents are encoded as ``(title + " " + text).strip()`` and queries as their ``text``, as MTEB
  1.x does for BEIR sets (mteb ``AbsTaskRetrieval`` / ``DenseRetrievalExactSearch``).
* STS (sentence pairs with gold scores):
  :class:`~sentence_transformers.sentence_transformer.evaluation.EmbeddingSimilarityEvaluator`; the
  headline is the Spearman rank correlation of cosine similarity with the gold scores (MTEB's STS
  main score).

No metric is computed here: cembed only loads data, encodes the corpus (with an on-disk cache keyed
by model and corpus fingerprints) and hands everything to those evaluators.

During training, :func:`build_training_evaluator` turns the config's ``eval`` section into one
evaluator for ``SentenceTransformerTrainer``; the trainer logs its metrics (prefixed ``eval_``)
next to the training loss and to the trackers in ``train.report_to``.
"""

from __future__ import annotations

import csv
import gzip
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from transformers import TrainerCallback

from cembed.errors import UserError
from cembed.model import load_eval_model, tokenizer_spec

# Bumped whenever the way documents are turned into text or encoded changes, so old caches miss.
CACHE_FORMAT = "cembed-corpus-v1"

# The metrics shown for each kind of set: (label, key suffix in the evaluator's output).
RETRIEVAL_HEADLINE = (
    ("NDCG@10", "cosine_ndcg@10"),
    ("MRR@10", "cosine_mrr@10"),
    ("MAP@100", "cosine_map@100"),
    ("Recall@10", "cosine_recall@10"),
    ("Recall@100", "cosine_recall@100"),
)
STS_HEADLINE = (("Spearman (cosine)", "spearman_cosine"), ("Pearson (cosine)", "pearson_cosine"))


# ----------------------------------------------------------------------------------------------
# Data


@dataclass
class RetrievalSet:
    """A BEIR retrieval set for one split.

    ``corpus`` maps document id -> the text encoded for it, ``(title + " " + text).strip()``, in
    file order; ``queries`` maps query id -> text for the queries that have at least one relevant
    document in the split; ``relevant_docs`` maps query id -> ids of documents with qrels score > 0.
    """

    name: str
    path: str
    split: str
    corpus: dict[str, str]
    queries: dict[str, str]
    relevant_docs: dict[str, set[str]]


@dataclass
class StsSet:
    """Sentence pairs with gold similarity scores (any scale; correlations ignore it)."""

    name: str
    path: str
    sentences1: list[str]
    sentences2: list[str]
    scores: list[float]


def _open_text(path: Path):
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")


def _read_jsonl(path: Path, required: tuple[str, ...]):
    """Yield ``(line_number, object)`` for each non-blank line.

    Raises:
        UserError: unreadable file, a line that is not a JSON object, or one without a ``required`` key.
    """
    try:
        with _open_text(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as err:
                    raise UserError(
                        f"{path}:{n}: not valid JSON ({err.msg}); each line must be one JSON object"
                    ) from None
                if not isinstance(obj, dict):
                    raise UserError(f"{path}:{n}: expected a JSON object per line, got {type(obj).__name__}")
                missing = [k for k in required if k not in obj]
                if missing:
                    raise UserError(f"{path}:{n}: missing field {missing[0]!r} (each line needs {', '.join(required)})")
                yield n, obj
    except (OSError, EOFError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: cannot read ({err.__class__.__name__}: {err})") from None


def document_text(title: Any, text: Any) -> str:
    """The string encoded for a BEIR document: ``(title + " " + text).strip()`` (MTEB's rule;
    a missing/None title or text counts as empty)."""
    return (f"{title or ''} {text or ''}").strip()


def _find(folder: Path, names: tuple[str, ...], what: str) -> Path:
    for name in names:
        if (folder / name).is_file():
            return folder / name
    raise UserError(
        f"{folder}: no {' or '.join(names)} ({what}); a BEIR folder holds corpus.jsonl[.gz], "
        "queries.jsonl and qrels/<split>.tsv"
    )


def load_qrels(path: Path) -> dict[str, dict[str, int]]:
    """Read a BEIR qrels TSV (``query-id<TAB>corpus-id<TAB>score``, optional header, LF or CRLF).

    Returns:
        query id -> {corpus id -> integer score}.

    Raises:
        UserError: a line with fewer than 3 fields or a non-integer score, naming file and line.
    """
    qrels: dict[str, dict[str, int]] = {}
    try:
        with open(path, encoding="utf-8", newline="") as f:
            for n, row in enumerate(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE), 1):
                if not row or not "".join(row).strip():
                    continue
                if len(row) < 3:
                    raise UserError(f"{path}:{n}: expected query-id, corpus-id, score separated by tabs; got {row!r}")
                qid, cid, raw = row[0].strip(), row[1].strip(), row[2].strip()
                try:
                    score = int(float(raw))
                except ValueError:
                    if n == 1:  # the header line: query-id corpus-id score
                        continue
                    raise UserError(f"{path}:{n}: score {raw!r} is not a number") from None
                qrels.setdefault(qid, {})[cid] = score
    except OSError as err:
        raise UserError(f"{path}: cannot read ({err.__class__.__name__}: {err})") from None
    return qrels


def load_beir(folder: str | Path, split: str = "test", name: str | None = None) -> RetrievalSet:
    """Load one split of a BEIR-layout retrieval set.

    Args:
        folder: holds ``corpus.jsonl`` or ``corpus.jsonl.gz`` (``_id``, ``title``, ``text``),
            ``queries.jsonl[.gz]`` (``_id``, ``text``) and ``qrels/<split>.tsv``.
        split: the qrels file to use (``test``, ``train``, ``dev``).
        name: label for metrics; defaults to ``<folder name>-<split>``.

    Returns:
        A :class:`RetrievalSet`; a qrels score <= 0 means "not relevant" and is left out.

    Raises:
        UserError: missing folder/file, bad JSON line, duplicate id, an empty corpus, a split without
            relevant pairs, or a qrels line naming a query or document that does not exist.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(
            f"{folder}: retrieval folder not found (expected a BEIR folder with corpus.jsonl[.gz], queries.jsonl, qrels/)"
        )
    corpus_path = _find(folder, ("corpus.jsonl", "corpus.jsonl.gz"), "the documents")
    queries_path = _find(folder, ("queries.jsonl", "queries.jsonl.gz"), "the queries")
    qrels_path = folder / "qrels" / f"{split}.tsv"
    if not qrels_path.is_file():
        found = sorted(p.stem for p in (folder / "qrels").glob("*.tsv")) if (folder / "qrels").is_dir() else []
        have = f"; available splits: {', '.join(found)}" if found else "; the folder has no qrels/*.tsv"
        raise UserError(f"{qrels_path}: qrels file for split {split!r} not found{have}")

    corpus: dict[str, str] = {}
    for n, obj in _read_jsonl(corpus_path, ("_id",)):
        if "text" not in obj and "title" not in obj:
            raise UserError(f"{corpus_path}:{n}: document has neither 'title' nor 'text'")
        doc_id = str(obj["_id"])
        if doc_id in corpus:
            raise UserError(f"{corpus_path}:{n}: duplicate document _id {doc_id!r}")
        corpus[doc_id] = document_text(obj.get("title"), obj.get("text"))
    if not corpus:
        raise UserError(f"{corpus_path}: the corpus has no documents")

    all_queries: dict[str, str] = {}
    for _, obj in _read_jsonl(queries_path, ("_id", "text")):
        all_queries[str(obj["_id"])] = str(obj["text"])

    qrels = load_qrels(qrels_path)
    relevant: dict[str, set[str]] = {}
    for qid, docs in qrels.items():
        if qid not in all_queries:
            raise UserError(
                f"{qrels_path}: query-id {qid!r} is not in {queries_path.name}; fix the qrels or the queries file"
            )
        for cid, score in docs.items():
            if cid not in corpus:
                raise UserError(
                    f"{qrels_path}: corpus-id {cid!r} (query {qid!r}) is not in {corpus_path.name}; fix the qrels or the corpus"
                )
            if score > 0:
                relevant.setdefault(qid, set()).add(cid)
    if not relevant:
        raise UserError(f"{qrels_path}: no (query, document) pair with score > 0; nothing to evaluate")
    queries = {qid: text for qid, text in all_queries.items() if qid in relevant}
    return RetrievalSet(
        name=name or f"{folder.name}-{split}",
        path=str(folder),
        split=split,
        corpus=corpus,
        queries=queries,
        relevant_docs=relevant,
    )


def _sts_row(row: list[str], where: str) -> tuple[str, str, float]:
    # STS Benchmark layout: genre, file, year, id, score, sentence1, sentence2[, notes...];
    # a plain 3-column file: sentence1, sentence2, score.
    if len(row) >= 7:
        raw, s1, s2 = row[4], row[5], row[6]
    elif len(row) == 3:
        s1, s2, raw = row
    else:
        raise UserError(
            f"{where}: expected 7 tab-separated fields (STS Benchmark: genre, file, year, id, score, "
            f"sentence1, sentence2) or 3 (sentence1, sentence2, score); got {len(row)}"
        )
    try:
        score = float(raw)
    except ValueError:
        raise UserError(f"{where}: score {raw!r} is not a number") from None
    return s1, s2, score


def load_sts(path: str | Path, name: str | None = None) -> StsSet:
    """Load STS pairs with gold scores.

    Formats: ``.jsonl[.gz]`` with ``sentence1``, ``sentence2``, ``score`` per line; otherwise a
    tab-separated file read with quoting disabled (sentences contain ``"``), either in the STS
    Benchmark layout (first 7 fields: genre, file, year, id, score, sentence1, sentence2; extra
    trailing fields ignored) or as ``sentence1, sentence2, score``. Sentences are used exactly as
    written (trailing spaces included, as MTEB does).

    Args:
        path: the file. name: label for metrics; defaults to the file name without extension.

    Raises:
        UserError: missing/unreadable file, a row with the wrong number of fields or a non-numeric
            score (naming file and line), fewer than 2 pairs, or all gold scores equal.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: STS file not found")
    s1s: list[str] = []
    s2s: list[str] = []
    scores: list[float] = []
    base = path.name.lower().removesuffix(".gz")
    if base.endswith(".jsonl"):
        for n, obj in _read_jsonl(path, ("sentence1", "sentence2", "score")):
            try:
                scores.append(float(obj["score"]))
            except (TypeError, ValueError):
                raise UserError(f"{path}:{n}: score {obj['score']!r} is not a number") from None
            s1s.append(str(obj["sentence1"]))
            s2s.append(str(obj["sentence2"]))
    else:
        try:
            with _open_text(path) as f:
                for n, row in enumerate(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE), 1):
                    if not row or not "".join(row).strip():
                        continue
                    try:
                        s1, s2, score = _sts_row(row, f"{path}:{n}")
                    except UserError:
                        if n == 1 and len(row) == 3:  # a header line: sentence1, sentence2, score
                            continue
                        raise
                    s1s.append(s1)
                    s2s.append(s2)
                    scores.append(score)
        except (OSError, EOFError, UnicodeDecodeError) as err:
            raise UserError(f"{path}: cannot read ({err.__class__.__name__}: {err})") from None
    if len(scores) < 2:
        raise UserError(f"{path}: needs at least 2 sentence pairs to correlate; found {len(scores)}")
    if len(set(scores)) == 1:
        raise UserError(f"{path}: every gold score is {scores[0]}; a correlation needs varying scores")
    stem = path.name
    for suffix in (".gz", ".jsonl", ".csv", ".tsv", ".txt"):
        stem = stem.removesuffix(suffix)
    return StsSet(name=name or stem, path=str(path), sentences1=s1s, sentences2=s2s, scores=scores)


# ----------------------------------------------------------------------------------------------
# Fingerprints and the corpus-embedding cache


def _hasher():
    import xxhash

    return xxhash.xxh3_128()


def model_fingerprint(model) -> str:
    """A hash of everything that decides a SentenceTransformer's embeddings.

    Covers every weight (name, dtype, shape, bytes), the module stack as printed (pooling mode,
    normalisation), max_seq_length, the tokenizer (vocabulary and rules, not its last
    padding/truncation state), the prompts and the device type. Two loads of the same saved
    model give the same fingerprint; any weight change gives another.

    Returns:
        32 hex characters (xxh3-128).
    """
    import torch

    h = _hasher()
    h.update(CACHE_FORMAT.encode())
    h.update(repr(model).encode())
    h.update(f"max_seq_length={getattr(model, 'max_seq_length', None)}|device={model.device.type}".encode())
    for key, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is not None:
        h.update(tokenizer_spec(tokenizer).encode())
    prompts = getattr(model, "prompts", None)
    h.update(json.dumps(prompts or {}, sort_keys=True).encode())
    return h.hexdigest()


def corpus_fingerprint(corpus: dict[str, str]) -> str:
    """A hash of the documents as encoded: ids and texts in order (32 hex characters, xxh3-128)."""
    h = _hasher()
    for doc_id, text in corpus.items():
        h.update(doc_id.encode())
        h.update(b"\x00")
        h.update(text.encode())
        h.update(b"\x01")
    return h.hexdigest()


def default_cache_dir() -> Path:
    """``$CEMBED_CACHE_DIR``, else ``$XDG_CACHE_HOME/cembed/embeddings`` (``~/.cache/cembed/embeddings``)."""
    if os.environ.get("CEMBED_CACHE_DIR"):
        return Path(os.environ["CEMBED_CACHE_DIR"]).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "cembed" / "embeddings"


def cache_path(cache_dir: str | Path, model_fp: str, corpus_fp: str) -> Path:
    """Where the corpus embeddings for (model, corpus) live: ``<cache_dir>/<model_fp>-<corpus_fp>.npy``."""
    return Path(cache_dir) / f"{model_fp}-{corpus_fp}.npy"


def _save_npy_atomic(path: Path, array: np.ndarray) -> None:
    from cembed.outputs import write_atomic

    write_atomic(path, lambda f: np.save(f, array), binary=True)


def _load_cached(path: Path, rows: int, dim: int | None) -> np.ndarray | None:
    """The cached array if it is readable and has the expected shape, else None (re-encode)."""
    if not path.is_file():
        return None
    try:
        arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    if arr.ndim != 2 or arr.shape[0] != rows or (dim is not None and arr.shape[1] != dim) or arr.dtype != np.float32:
        return None
    return arr


ProgressFn = Callable[[int, int], None]  # (done, total) -> None


def encode_documents(model, texts: list[str], batch_size: int = 32, progress: ProgressFn | None = None) -> np.ndarray:
    """Encode ``texts`` with ``model.encode_document``; returns float32 ``(len(texts), dim)``.

    Texts are sorted by length (longest first, as ``encode`` does internally) and encoded in chunks
    of ``batch_size * 8`` so ``progress(done, total)`` can be reported; the output is in input order.
    Padding is masked, so chunking does not change the embeddings beyond float rounding.
    """
    order = np.argsort([-len(t) for t in texts], kind="stable")
    out: np.ndarray | None = None
    chunk = batch_size * 8
    done = 0
    if progress:
        progress(0, len(texts))
    for start in range(0, len(texts), chunk):
        idx = order[start : start + chunk]
        emb = model.encode_document(
            [texts[i] for i in idx], batch_size=batch_size, convert_to_numpy=True, show_progress_bar=False
        ).astype(np.float32, copy=False)
        if out is None:
            out = np.empty((len(texts), emb.shape[1]), dtype=np.float32)
        out[idx] = emb
        done += len(idx)
        if progress:
            progress(done, len(texts))
    assert out is not None
    return out


@dataclass
class CorpusEmbeddings:
    """Corpus embeddings plus where they came from."""

    embeddings: np.ndarray  # float32 (n_docs, dim), in corpus order
    cache_file: str | None
    cache_hit: bool
    encode_seconds: float


def corpus_embeddings(
    model,
    corpus: dict[str, str],
    batch_size: int = 32,
    cache_dir: str | Path | None = None,
    progress: ProgressFn | None = None,
    model_fp: str | None = None,
) -> CorpusEmbeddings:
    """Embeddings of every corpus document, read from / written to the on-disk cache.

    The cache file is keyed by :func:`model_fingerprint` and :func:`corpus_fingerprint`, so a
    changed weight, tokenizer, max_seq_length or document misses, and the same model on the same
    corpus never re-encodes. ``cache_dir=None`` disables the cache. A corrupt or mis-shaped cache
    file is ignored and rewritten. Writes are atomic.
    """
    texts = list(corpus.values())
    path = None
    if cache_dir is not None:
        path = cache_path(cache_dir, model_fp or model_fingerprint(model), corpus_fingerprint(corpus))
        get_dim = getattr(model, "get_embedding_dimension", None) or getattr(
            model, "get_sentence_embedding_dimension", None
        )
        dim = get_dim() if get_dim else None
        cached = _load_cached(path, len(texts), dim)
        if cached is not None:
            if progress:
                progress(len(texts), len(texts))
            return CorpusEmbeddings(cached, str(path), True, 0.0)
    t0 = time.perf_counter()
    emb = encode_documents(model, texts, batch_size, progress)
    seconds = time.perf_counter() - t0
    if path is not None:
        try:
            _save_npy_atomic(path, emb)
        except OSError as err:
            raise UserError(
                f"{path.parent}: cannot write the embedding cache ({err}); use another --cache-dir or --no-cache"
            ) from None
    return CorpusEmbeddings(emb, str(path) if path else None, False, seconds)


# ----------------------------------------------------------------------------------------------
# Evaluators (sentence-transformers' own metric code)


def retrieval_evaluator(rs: RetrievalSet, batch_size: int = 32, write_csv: bool = False):
    """An ``InformationRetrievalEvaluator`` for ``rs`` with cosine similarity (as MTEB), metrics
    Accuracy/Precision/Recall@{1,3,5,10,100}, MRR@10, NDCG@10 and MAP@100. Its metric keys are
    ``<rs.name>_cosine_<metric>@<k>``; its primary metric ``<rs.name>_cosine_ndcg@10``."""
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator
    from sentence_transformers.util import cos_sim

    return InformationRetrievalEvaluator(
        queries=rs.queries,
        corpus=rs.corpus,
        relevant_docs=rs.relevant_docs,
        mrr_at_k=[10],
        ndcg_at_k=[10],
        accuracy_at_k=[1, 3, 5, 10],
        precision_recall_at_k=[1, 3, 5, 10, 100],
        map_at_k=[100],
        batch_size=batch_size,
        name=rs.name,
        write_csv=write_csv,
        score_functions={"cosine": cos_sim},
        main_score_function="cosine",
    )


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
) -> tuple[dict[str, float], CorpusEmbeddings]:
    """Score ``model`` on ``rs``: corpus embeddings from the cache (or encoded), queries encoded by
    the evaluator, metrics by ``InformationRetrievalEvaluator``.

    Returns:
        ``(metrics, corpus_embeddings)``; metrics keyed ``<rs.name>_cosine_<metric>@<k>``.
    """
    import torch

    ce = corpus_embeddings(model, rs.corpus, batch_size, cache_dir, progress, model_fp)
    evaluator = retrieval_evaluator(rs, batch_size)
    metrics = evaluator(model, corpus_embeddings=torch.from_numpy(ce.embeddings).to(model.device))
    return {k: float(v) for k, v in metrics.items()}, ce


def evaluate_sts(model, sts: StsSet, batch_size: int = 32) -> dict[str, float]:
    """Score ``model`` on ``sts`` with ``EmbeddingSimilarityEvaluator``; keys ``<name>_spearman_cosine`` etc."""
    metrics = sts_evaluator(sts, batch_size)(model)
    return {k: float(v) for k, v in metrics.items()}


def headline(metrics: dict[str, float], name: str, kind: str) -> dict[str, float]:
    """The few metrics shown for a set: label -> value (``kind`` is ``retrieval`` or ``sts``)."""
    rows = RETRIEVAL_HEADLINE if kind == "retrieval" else STS_HEADLINE
    return {label: metrics[f"{name}_{suffix}"] for label, suffix in rows if f"{name}_{suffix}" in metrics}


# ----------------------------------------------------------------------------------------------
# Evaluation during training


@dataclass
class EvalSets:
    """The loaded sets of a config's ``eval`` section."""

    retrieval: list[RetrievalSet] = field(default_factory=list)
    sts: list[StsSet] = field(default_factory=list)


def load_eval_sets(eval_cfg) -> EvalSets:
    """Load every set named in the config's ``eval`` section (see :class:`cembed.config.EvalConfig`).

    Raises:
        UserError: as :func:`load_beir` / :func:`load_sts`; also two sets with the same name.
    """

    def named(field: str, i: int, load):
        try:
            return load()
        except UserError as err:
            raise UserError(f"eval.{field}[{i}]: {err}") from None

    sets = EvalSets(
        retrieval=[
            named("retrieval", i, lambda r=r: load_beir(r.path, r.split, r.name))
            for i, r in enumerate(eval_cfg.retrieval)
        ],
        sts=[named("sts", i, lambda s=s: load_sts(s.path, s.name)) for i, s in enumerate(eval_cfg.sts)],
    )
    names = [s.name for s in sets.retrieval] + [s.name for s in sets.sts]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise UserError(f"eval: two sets are named {dup!r}; give each a distinct 'name'")
    return sets


def build_training_evaluator(sets: EvalSets, batch_size: int = 32):
    """One evaluator for the trainer: the sets' evaluators in a ``SequentialEvaluator`` (metrics of
    all sets, each prefixed by its set name). Corpus embeddings are not cached here: the weights
    change between evaluations."""
    from sentence_transformers.base.evaluation import SequentialEvaluator

    evaluators = [retrieval_evaluator(r, batch_size) for r in sets.retrieval]
    evaluators += [sts_evaluator(s, batch_size) for s in sets.sts]
    return SequentialEvaluator(evaluators)


def metric_names(sets: EvalSets) -> list[str]:
    """Metric names usable as ``eval.metric_for_best_model`` (the trainer logs them with an
    ``eval_`` prefix)."""
    names = []
    for r in sets.retrieval:
        names += [f"{r.name}_{suffix}" for _, suffix in RETRIEVAL_HEADLINE]
        names += [f"{r.name}_cosine_{m}@{k}" for m in ("accuracy", "precision") for k in (1, 3, 5, 10)]
        names += [f"{r.name}_cosine_recall@{k}" for k in (1, 3, 5)]
        names += [f"{r.name}_cosine_precision@100"]
    for s in sets.sts:
        names += [f"{s.name}_{suffix}" for _, suffix in STS_HEADLINE]
    return names


def check_metric_name(metric: str | None, sets: EvalSets) -> str | None:
    """Normalise ``eval.metric_for_best_model`` (an optional ``eval_`` prefix is dropped) and check it
    is a metric the sets produce.

    Raises:
        UserError: unknown metric, with a did-you-mean and the headline choices.
    """
    import difflib

    if metric is None:
        return None
    bare = metric.removeprefix("eval_")
    known = metric_names(sets) + ["loss"]
    if bare in known:
        return bare
    close = difflib.get_close_matches(bare, known, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    choices = ", ".join(known[: 6 if sets.retrieval else 2])
    raise UserError(f"eval.metric_for_best_model: {metric!r} is not a metric of the eval sets{hint} (e.g. {choices})")


def greater_is_better(metric: str, explicit: bool | None) -> bool:
    """``explicit`` when set, else False for a loss and True for every other metric."""
    if explicit is not None:
        return explicit
    return not metric.endswith("loss")


def training_eval_args(eval_cfg, metric: str | None, save_steps: int | None) -> dict[str, Any]:
    """Training-argument overrides for evaluation during training.

    ``eval_steps`` -> ``eval_strategy="steps"``; with a ``metric_for_best_model`` a checkpoint is
    saved at every evaluation (or at ``train.save_steps`` when set, which must then be a multiple of
    ``eval_steps``), the best one is kept and loaded at the end.

    Raises:
        UserError: ``train.save_steps`` not a multiple of ``eval.eval_steps`` with a best-model metric.
    """
    if eval_cfg is None or eval_cfg.eval_steps is None:
        return {}
    args: dict[str, Any] = {"eval_strategy": "steps", "eval_steps": eval_cfg.eval_steps}
    if metric is not None:
        if save_steps is not None and save_steps % eval_cfg.eval_steps:
            raise UserError(
                f"train.save_steps ({save_steps}) must be a multiple of eval.eval_steps ({eval_cfg.eval_steps}) "
                "to keep the best checkpoint; change one of them or unset train.save_steps"
            )
        args.update(
            save_strategy="steps",
            save_steps=save_steps or eval_cfg.eval_steps,
            load_best_model_at_end=True,
            metric_for_best_model=metric,
            greater_is_better=greater_is_better(metric, eval_cfg.greater_is_better),
            save_total_limit=eval_cfg.save_total_limit,
        )
    return args


class EvalLogCallback(TrainerCallback):
    """Trainer callback that records each evaluation (step, metrics without the ``eval_`` prefix)
    and prints one line per evaluation with the headline metrics."""

    def __init__(self, console=None, headline_keys: list[str] | None = None) -> None:
        self.console = console
        self.history: list[dict[str, Any]] = []
        self.headline_keys = headline_keys or []

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        metrics = {
            k.removeprefix("eval_"): float(v)
            for k, v in logs.items()
            if k.startswith("eval_") and isinstance(v, (int, float))
        }
        metrics = {k: v for k, v in metrics.items() if k not in ("runtime", "samples_per_second", "steps_per_second")}
        if not metrics:
            return
        self.history.append({"step": state.global_step, "metrics": metrics})
        if self.console is not None:
            shown = [k for k in self.headline_keys if k in metrics] or list(metrics)[:4]
            text = "  ".join(f"{k} {metrics[k]:.4f}" for k in shown)
            self.console.print(f"eval step {state.global_step}: {text}", highlight=False)


def headline_keys(sets: EvalSets) -> list[str]:
    """The primary metric of each set: ``<name>_cosine_ndcg@10`` / ``<name>_spearman_cosine``."""
    return [f"{r.name}_cosine_ndcg@10" for r in sets.retrieval] + [f"{s.name}_spearman_cosine" for s in sets.sts]


def run_evaluator(evaluator, model) -> dict[str, float]:
    """Call a (sequential) evaluator outside the trainer; returns float metrics without the
    ``sequential_score`` entry."""
    metrics = evaluator(model)
    return {k: float(v) for k, v in metrics.items() if k != "sequential_score"}


@dataclass
class TrainingEvaluation:
    """Everything ``run_training`` needs to evaluate before, during and after training."""

    sets: EvalSets
    evaluator: Any
    metric: str | None  # metric_for_best_model without the eval_ prefix
    training_args: dict[str, Any]
    callback: EvalLogCallback
    batch_size: int = 32

    @classmethod
    def from_config(cls, eval_cfg, save_steps: int | None, console=None) -> TrainingEvaluation:
        """Load the sets of ``eval_cfg`` and build evaluator, training-argument overrides and log
        callback.

        Raises:
            UserError: see :func:`load_eval_sets`, :func:`check_metric_name`, :func:`training_eval_args`.
        """
        sets = load_eval_sets(eval_cfg)
        metric = check_metric_name(eval_cfg.metric_for_best_model, sets)
        return cls(
            sets=sets,
            evaluator=build_training_evaluator(sets, eval_cfg.batch_size),
            metric=metric,
            training_args=training_eval_args(eval_cfg, metric, save_steps),
            callback=EvalLogCallback(console, headline_keys(sets)),
            batch_size=eval_cfg.batch_size,
        )

    def evaluate(self, model, label: str, cache_dir: str | Path | None = None) -> dict[str, float]:
        """Run every set's evaluator on ``model`` and print the headline metrics under ``label``.

        With ``cache_dir`` (used before training, when the weights are the base model's) retrieval
        corpora come from / go to the corpus-embedding cache; the metrics are the same.
        """
        if cache_dir is None:
            metrics = run_evaluator(self.evaluator, model)
        else:
            metrics = {}
            fp = model_fingerprint(model) if self.sets.retrieval else None
            for rs in self.sets.retrieval:
                metrics.update(evaluate_retrieval(model, rs, self.batch_size, cache_dir, model_fp=fp)[0])
            for ss in self.sets.sts:
                metrics.update(evaluate_sts(model, ss, self.batch_size))
        if self.callback.console is not None:
            shown = "  ".join(f"{k} {metrics[k]:.4f}" for k in headline_keys(self.sets) if k in metrics)
            self.callback.console.print(f"eval {label}: {shown}", highlight=False)
        return metrics

    def summary(self, before: dict[str, float], after: dict[str, float], state) -> dict[str, Any]:
        """The ``eval`` block of ``run_summary.json``: metrics before and after training, every
        evaluation during training, and the best checkpoint (when a metric was chosen)."""
        best = None
        if self.metric is not None:
            ckpt = getattr(state, "best_model_checkpoint", None)
            best = {
                "metric": self.metric,
                "greater_is_better": self.training_args.get("greater_is_better"),
                "value": getattr(state, "best_metric", None),
                "step": int(Path(ckpt).name.rsplit("-", 1)[-1]) if ckpt else None,
                "checkpoint": ckpt,
                "note": "the model saved in output_dir is this checkpoint (loaded at the end of training)",
            }
        return {
            "sets": [
                {
                    "name": r.name,
                    "kind": "retrieval",
                    "path": r.path,
                    "split": r.split,
                    "queries": len(r.queries),
                    "documents": len(r.corpus),
                }
                for r in self.sets.retrieval
            ]
            + [{"name": s.name, "kind": "sts", "path": s.path, "pairs": len(s.scores)} for s in self.sets.sts],
            "before": before,
            "after": after,
            "during": self.callback.history,
            "best": best,
        }


# ----------------------------------------------------------------------------------------------
# The `cembed eval` command


def run_eval_cli(
    console,
    model_name: str,
    retrieval: list[Path],
    sts: list[Path],
    split: str = "test",
    json_out: Path | None = None,
    batch_size: int = 32,
    max_seq_length: int | None = None,
    device: str = "auto",
    cache_dir: Path | None = None,
    no_cache: bool = False,
) -> dict[str, Any]:
    """Load the sets and the model, score it, print a rich table and optionally write ``json_out``.

    Returns:
        The report also written as JSON: model, fingerprint, and per set its kind, size, headline
        metrics, every evaluator metric, whether the corpus came from the cache and encode seconds.

    Raises:
        UserError: no set given, or any loader/model error (see :func:`load_beir`, :func:`load_sts`,
            :func:`load_eval_model`).
    """
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.table import Table

    from cembed.model import quiet_libraries
    from cembed.outputs import write_json_atomic

    if not retrieval and not sts:
        raise UserError("cembed eval: give at least one --retrieval FOLDER or --sts FILE")
    if json_out is not None and json_out.is_dir():
        raise UserError(f"--json {json_out}: is a folder; give a file name such as results.json")
    # Data first: a typo in a path should not cost a model load.
    rsets = [load_beir(p, split) for p in retrieval]
    ssets = [load_sts(p) for p in sts]
    names = [s.name for s in rsets] + [s.name for s in ssets]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise UserError(f"cembed eval: two sets are named {dup!r}; rename one folder/file")
    quiet_libraries()
    model = load_eval_model(model_name, device, max_seq_length)
    fp = model_fingerprint(model)
    cache = None if no_cache else (cache_dir or default_cache_dir())

    report: dict[str, Any] = {
        "model": model_name,
        "model_fingerprint": fp,
        "max_seq_length": model.max_seq_length,
        "device": str(model.device),
        "split": split,
        "sets": {},
    }
    for rs in rsets:
        with Progress(
            TextColumn(f"[bold]encode {rs.name} corpus"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=True,
        ) as bar:
            task = bar.add_task("encode", total=len(rs.corpus))
            metrics, ce = evaluate_retrieval(
                model, rs, batch_size, cache, lambda done, total: bar.update(task, completed=done), model_fp=fp
            )
        report["sets"][rs.name] = {
            "kind": "retrieval",
            "path": rs.path,
            "split": rs.split,
            "queries": len(rs.queries),
            "documents": len(rs.corpus),
            "headline": headline(metrics, rs.name, "retrieval"),
            "metrics": metrics,
            "corpus_cache": ce.cache_file,
            "corpus_cache_hit": ce.cache_hit,
            "encode_seconds": round(ce.encode_seconds, 2),
        }
    for ss in ssets:
        metrics = evaluate_sts(model, ss, batch_size)
        report["sets"][ss.name] = {
            "kind": "sts",
            "path": ss.path,
            "pairs": len(ss.scores),
            "headline": headline(metrics, ss.name, "sts"),
            "metrics": metrics,
        }

    table = Table("set", "size", "metric", "value", title=f"{model_name}  (fingerprint {fp[:12]})")
    for name, entry in report["sets"].items():
        size = (
            f"{entry['queries']} q / {entry['documents']} docs"
            if entry["kind"] == "retrieval"
            else f"{entry['pairs']} pairs"
        )
        for i, (label, value) in enumerate(entry["headline"].items()):
            table.add_row(name if i == 0 else "", size if i == 0 else "", label, f"{value:.5f}")
        if entry["kind"] == "retrieval":
            how = "from cache" if entry["corpus_cache_hit"] else f"encoded in {entry['encode_seconds']:.1f}s"
            table.add_row("", "", "corpus", how)
    console.print(table)
    if json_out is not None:
        write_json_atomic(json_out, report)
        console.print(f"metrics written to {json_out}", highlight=False)
    return report
