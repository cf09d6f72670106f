"""BEIR folders read from disk: the file layout, the qrels TSV, the corpus and the queries.

A BEIR folder holds ``corpus.jsonl[.gz]`` (``_id``, ``title``, ``text``), ``queries.jsonl[.gz]``
(``_id``, ``text``) and ``qrels/<split>.tsv`` (``query-id<TAB>corpus-id<TAB>score``). A document is
the text ``(title + " " + text).strip()`` (:func:`document_text`, MTEB 1.x's rule for BEIR sets).
Both the training source ``{beir: folder}`` (:func:`cembed.data.sources.beir.load_beir_pairs`) and the
evaluation sets (:func:`cembed.eval.sets.load_beir`) read a folder through these functions, so they
agree on every text and on every refusal. Every malformed input is a
:class:`~cembed.errors.UserError` naming the file (and line).
"""

from __future__ import annotations

import csv
import gzip
import json
from pathlib import Path
from typing import Any

from cembed.config.sources import BeirSource
from cembed.errors import UserError


def open_text(path: Path):
    """A text file (gzip when its name ends in ``.gz``) opened for reading as UTF-8, newlines kept as written."""
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")


def read_jsonl(path: Path, required: tuple[str, ...]):
    """Yield ``(line_number, object)`` for each non-blank line.

    Raises:
        UserError: unreadable file, a line that is not a JSON object, or one without a ``required`` key.
    """
    try:
        with open_text(path) as f:
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


def qrels_lines(path: Path):
    """Yield ``(line_number, query_id, corpus_id, score)`` for each row of a BEIR qrels TSV
    (``query-id<TAB>corpus-id<TAB>score``, optional header, LF or CRLF), in file order.

    Raises:
        UserError: a line with fewer than 3 fields or a non-integer score, naming file and line.
    """
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
                yield n, qid, cid, score
    except OSError as err:
        raise UserError(f"{path}: cannot read ({err.__class__.__name__}: {err})") from None


def load_qrels(path: Path) -> dict[str, dict[str, int]]:
    """Read a BEIR qrels TSV (see :func:`qrels_lines`); a repeated (query, document) keeps its last score.

    Returns:
        query id -> {corpus id -> integer score}.

    Raises:
        UserError: a line with fewer than 3 fields or a non-integer score, naming file and line.
    """
    qrels: dict[str, dict[str, int]] = {}
    for _, qid, cid, score in qrels_lines(path):
        qrels.setdefault(qid, {})[cid] = score
    return qrels


def beir_files(folder: str | Path, split: str) -> tuple[Path, Path, Path]:
    """``(corpus, queries, qrels)`` paths of a BEIR folder's ``split``.

    Raises:
        UserError: no such folder, no corpus or queries file, or no ``qrels/<split>.tsv`` (listing
            the splits that exist).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(
            f"{folder}: retrieval (BEIR) folder not found (expected a folder with corpus.jsonl[.gz], queries.jsonl, qrels/)"
        )
    corpus_path = _find(folder, ("corpus.jsonl", "corpus.jsonl.gz"), "the documents")
    queries_path = _find(folder, ("queries.jsonl", "queries.jsonl.gz"), "the queries")
    qrels_path = folder / "qrels" / f"{split}.tsv"
    if not qrels_path.is_file():
        found = sorted(p.stem for p in (folder / "qrels").glob("*.tsv")) if (folder / "qrels").is_dir() else []
        have = f"; available splits: {', '.join(found)}" if found else "; the folder has no qrels/*.tsv"
        raise UserError(f"{qrels_path}: qrels file for split {split!r} not found{have}")
    return corpus_path, queries_path, qrels_path


def read_corpus(path: Path) -> dict[str, str]:
    """Document id -> :func:`document_text`, in file order, from a BEIR ``corpus.jsonl[.gz]``.

    Raises:
        UserError: a bad JSON line, a document with neither title nor text, a duplicate id, no documents.
    """
    corpus: dict[str, str] = {}
    for n, obj in read_jsonl(path, ("_id",)):
        if "text" not in obj and "title" not in obj:
            raise UserError(f"{path}:{n}: document has neither 'title' nor 'text'")
        doc_id = str(obj["_id"])
        if doc_id in corpus:
            raise UserError(f"{path}:{n}: duplicate document _id {doc_id!r}")
        corpus[doc_id] = document_text(obj.get("title"), obj.get("text"))
    if not corpus:
        raise UserError(f"{path}: the corpus has no documents")
    return corpus


def read_queries(path: Path) -> dict[str, str]:
    """Query id -> text from a BEIR ``queries.jsonl[.gz]``.

    Raises:
        UserError: a bad JSON line or one without ``_id`` / ``text``.
    """
    return {str(obj["_id"]): str(obj["text"]) for _, obj in read_jsonl(path, ("_id", "text"))}


def load_beir_pairs(source: BeirSource):
    """(query, document) training pairs from a BEIR folder's ``qrels/<split>.tsv``, in file order:
    ``anchor`` is the query text, ``positive`` the document as ``(title + " " + text).strip()`` (the
    evaluator's rule, :func:`cembed.data.sources.beir.document_text`), plus ``query_id`` and ``doc_id``. Rows
    with score <= 0 are left out; a repeated (query, document) line counts once (its last score).
    A document relevant to several queries appears in several rows: the no-duplicates sampler keeps
    them in different batches.

    Raises:
        UserError: a missing folder or file (see :func:`cembed.data.sources.beir.beir_files`), a bad corpus,
            queries or qrels line, a qrels line naming a query or document that does not exist (file
            and line), or no pair with a positive score.
    """
    import datasets

    corpus_path, queries_path, qrels_path = beir_files(source.path, source.split)
    corpus, queries = read_corpus(corpus_path), read_queries(queries_path)
    pairs: dict[tuple[str, str], int] = {}
    for n, qid, cid, score in qrels_lines(qrels_path):
        if qid not in queries:
            raise UserError(f"{qrels_path}:{n}: query-id {qid!r} is not in {queries_path.name}")
        if cid not in corpus:
            raise UserError(f"{qrels_path}:{n}: corpus-id {cid!r} (query {qid!r}) is not in {corpus_path.name}")
        pairs.pop((qid, cid), None)  # a repeated line takes the later position and score
        pairs[(qid, cid)] = score
    kept = [key for key, score in pairs.items() if score > 0]
    if not kept:
        raise UserError(f"{qrels_path}: no (query, document) pair with score > 0; nothing to train on")
    return datasets.Dataset.from_dict(
        {
            "anchor": [queries[q] for q, _ in kept],
            "positive": [corpus[d] for _, d in kept],
            "query_id": [q for q, _ in kept],
            "doc_id": [d for _, d in kept],
        }
    )
