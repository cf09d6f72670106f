"""The evaluation sets: BEIR retrieval sets and STS pairs, loaded the way MTEB reads them.

* Retrieval (BEIR layout: ``corpus.jsonl[.gz]``, ``queries.jsonl``, ``qrels/<split>.tsv``):
  documents are encoded as ``(title + " " + text).strip()`` and queries as their ``text``, as MTEB
  1.x does for BEIR sets (mteb ``AbsTaskRetrieval`` / ``DenseRetrievalExactSearch``).
* STS (sentence pairs with gold scores): STS Benchmark TSV, ``sentence1, sentence2, score`` TSV or
  JSONL, sentences used exactly as written.

Every malformed input is a :class:`~cembed.errors.UserError` naming the file (and line). The BEIR
file readers live in :mod:`cembed.data.sources.beir` (training reads the same folders); the scoring itself
lives in :mod:`cembed.eval.evaluators`.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path

from cembed.data.sources.beir import beir_files, load_qrels, open_text, read_corpus, read_jsonl, read_queries
from cembed.errors import UserError


@dataclass
class RetrievalSet:
    """A BEIR retrieval set for one split.

    ``corpus`` maps document id -> the text encoded for it, ``(title + " " + text).strip()``, in
    file order; ``queries`` maps query id -> text for the queries that have at least one relevant
    document in the split; ``relevant_docs`` maps query id -> ids of documents with qrels score > 0;
    ``relevance`` maps query id -> {document id -> that score} (the grades graded NDCG uses).
    """

    name: str
    path: str
    split: str
    corpus: dict[str, str]
    queries: dict[str, str]
    relevant_docs: dict[str, set[str]]
    relevance: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def size(self) -> str:
        """What it holds, in words (``5183 documents, 300 queries``)."""
        return f"{len(self.corpus)} documents, {len(self.queries)} queries"

    def digest(self) -> str:
        """A hash (xxh3-128) of what it scores by: documents, queries and graded qrels, in file order."""
        qrels = ((q, sorted(grades.items())) for q, grades in self.relevance.items())
        return _digest(self.corpus.items(), self.queries.items(), qrels)


@dataclass
class StsSet:
    """Sentence pairs with gold similarity scores (any scale; correlations ignore it)."""

    name: str
    path: str
    sentences1: list[str]
    sentences2: list[str]
    scores: list[float]

    @property
    def size(self) -> str:
        """What it holds, in words (``1379 pairs``)."""
        return f"{len(self.scores)} pairs"

    def digest(self) -> str:
        """A hash (xxh3-128) of its pairs and gold scores, in file order."""
        return _digest(zip(self.sentences1, self.sentences2, self.scores))


def _digest(*sections) -> str:
    """xxh3-128 of each section's items as JSON, one at a time, a separator after each section."""
    import xxhash

    h = xxhash.xxh3_128()
    for items in sections:
        for item in items:
            h.update(json.dumps(item, ensure_ascii=False).encode("utf-8") + b"\n")
        h.update(b"\x00")
    return h.hexdigest()


def load_beir(folder: str | Path, split: str = "test", name: str | None = None) -> RetrievalSet:
    """Load one split of a BEIR-layout retrieval set.

    Args:
        folder: holds ``corpus.jsonl`` or ``corpus.jsonl.gz`` (``_id``, ``title``, ``text``),
            ``queries.jsonl[.gz]`` (``_id``, ``text``) and ``qrels/<split>.tsv``.
        split: the qrels file to use (``test``, ``train``, ``dev``).
        name: label for metrics; defaults to ``<folder name>-<split>``.

    Returns:
        A :class:`RetrievalSet`; a qrels score <= 0 means "not relevant" and is left out; the
        positive scores are kept as grades (``relevance``).

    Raises:
        UserError: missing folder/file, bad JSON line, duplicate id, an empty corpus, a split without
            relevant pairs, or a qrels line naming a query or document that does not exist.
    """
    folder = Path(folder)
    corpus_path, queries_path, qrels_path = beir_files(folder, split)
    corpus = read_corpus(corpus_path)
    all_queries = read_queries(queries_path)

    qrels = load_qrels(qrels_path)
    relevant: dict[str, set[str]] = {}
    grades: dict[str, dict[str, int]] = {}
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
                grades.setdefault(qid, {})[cid] = score
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
        relevance=grades,
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
        for n, obj in read_jsonl(path, ("sentence1", "sentence2", "score")):
            try:
                scores.append(float(obj["score"]))
            except (TypeError, ValueError):
                raise UserError(f"{path}:{n}: score {obj['score']!r} is not a number") from None
            s1s.append(str(obj["sentence1"]))
            s2s.append(str(obj["sentence2"]))
    else:
        try:
            with open_text(path) as f:
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


@dataclass
class EvalSets:
    """The loaded sets of a config's ``eval`` section."""

    retrieval: list[RetrievalSet] = field(default_factory=list)
    sts: list[StsSet] = field(default_factory=list)


def load_eval_sets(eval_cfg) -> EvalSets:
    """Load every set named in the config's ``eval`` section (see :class:`cembed.config.schema.EvalConfig`).

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
