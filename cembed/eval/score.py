"""``cembed eval``: score a saved model on BEIR retrieval folders and STS files, at full size
(:func:`score_model`) or at several truncated sizes (:func:`score_dims`, ``--dims``).

Both go through one setup (:func:`prepare_eval`): the checks (a set given, ``--json`` not a folder, no
two sets of one name), the sets from :mod:`cembed.eval.sets` (loaded before the model, so a wrong path
fails fast), the model, its fingerprint, the corpus cache (:func:`cembed.files.cache_root`
``("embeddings", cache_dir)``) and the prompts. Retrieval queries get the model's query prompt and
corpora its document prompt (:func:`cembed.model.prompts.resolve_prompts` with no ``data.prompts``:
the same rule as training), so the numbers are those of the model as it is used. The corpus cache is
keyed by the model fingerprint and the corpus with that document prompt, the same key with and
without ``--dims``: ``cembed eval --dims`` after ``cembed eval`` reads the corpus from the cache.

``--dims 384,128,64`` scores truncated embeddings (the first ``d`` dimensions; by the model's similarity: cosine
normalizes them), as a Matryoshka-trained model is used (Kusupati et al. 2022, arXiv:2205.13147).
Queries and STS sentences are encoded through sentence-transformers' ``truncate_dim``; the corpus is
encoded (or read from the cache) once at full size and sliced, so the cache keeps full-size embeddings.

The metrics come from :mod:`cembed.eval.evaluators` (sentence-transformers' evaluators).
Nothing here prints; :mod:`cembed.cli.commands.eval` shows the :class:`EvalReport` and :class:`DimsReport`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from cembed.errors import UserError
from cembed.eval.embedding_cache import ProgressFn, corpus_embeddings
from cembed.eval.evaluators import (
    evaluate_retrieval,
    evaluate_sts,
    headline,
    retrieval_evaluator,
    scored_by,
    similarity_of,
)
from cembed.eval.sets import RetrievalSet, StsSet, load_beir, load_sts
from cembed.files import cache_root
from cembed.model.fingerprint import model_fingerprint
from cembed.model.load import load_eval_model
from cembed.model.prompts import resolve_prompts

# (set name, n_documents) -> a context manager giving the (done, total) encode callback:
EncodeProgress = Callable[[str, int], AbstractContextManager[ProgressFn | None]]


@dataclass
class EvalSetup:
    """What :func:`prepare_eval` loaded for one ``cembed eval``: the sets, the model, its fingerprint,
    the corpus-embedding folder (None: no cache) and the resolved prompts
    (:class:`cembed.model.prompts.RolePrompts`: anchor = query, positive = document)."""

    retrieval: list[RetrievalSet]
    sts: list[StsSet]
    model: Any
    fingerprint: str
    cache: Path | None
    prompts: Any

    def progress_for(self, progress: EncodeProgress | None, rs: RetrievalSet):
        """The context manager around one retrieval set's corpus encoding (``progress`` or a null one)."""
        return progress(rs.name, len(rs.corpus)) if progress else contextlib.nullcontext(None)


def prepare_eval(
    model_name: str,
    retrieval: list[Path],
    sts: list[Path],
    split: str = "test",
    json_out: Path | None = None,
    max_seq_length: int | None = None,
    device: str = "auto",
    cache_dir: Path | None = None,
    no_cache: bool = False,
) -> EvalSetup:
    """The one setup of ``cembed eval`` (with or without ``--dims``): check the arguments, load the sets
    (before the model: a typo in a path should not cost a model load), then the model, and resolve its
    fingerprint, the corpus cache (:func:`cembed.files.cache_root` ``("embeddings", cache_dir)``; None with
    ``no_cache``) and its prompts.

    Raises:
        UserError: no set given, ``json_out`` a folder, two sets with the same name, or any
            loader/model error (see :func:`~cembed.eval.sets.load_beir`,
            :func:`~cembed.eval.sets.load_sts`, :func:`~cembed.model.load.load_eval_model`).
    """
    from cembed.model.load import quiet_libraries

    if not retrieval and not sts:
        raise UserError("cembed eval: give at least one --retrieval FOLDER or --sts FILE")
    if json_out is not None and json_out.is_dir():
        raise UserError(f"--json {json_out}: is a folder; give a file name such as results.json")
    rsets = [load_beir(p, split) for p in retrieval]
    ssets = [load_sts(p) for p in sts]
    names = [s.name for s in rsets] + [s.name for s in ssets]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise UserError(f"cembed eval: two sets are named {dup!r}; rename one folder/file")
    quiet_libraries()
    model = load_eval_model(model_name, device, max_seq_length)
    if ssets and similarity_of(model) != "cosine":
        raise UserError(
            f"--sts: {model_name} scores a query and a document by {scored_by(model)}, not one vector per text; "
            "STS is for dense models: evaluate it with --retrieval"
        )
    cache = None if no_cache else cache_root("embeddings", cache_dir)
    return EvalSetup(rsets, ssets, model, model_fingerprint(model), cache, resolve_prompts(None, model))


def _write_json(report, json_out: Path | None) -> None:
    if json_out is not None:
        from cembed.files import write_json_atomic

        write_json_atomic(json_out, report.to_dict())
        report.json_out = json_out


@dataclass
class EvalReport:
    """What :func:`score_model` measured. ``sets``: name -> {kind "retrieval": path, split, queries, documents,
    headline (label -> value), metrics (all), corpus_cache, corpus_cache_hit, encode_seconds (0.01 s; 0 on a hit)}
    or {kind "sts": path, pairs, headline, metrics}. ``json_out``: where :meth:`to_dict` was written, if anywhere."""

    model: str
    model_fingerprint: str
    max_seq_length: int | None
    device: str
    split: str
    sets: dict[str, dict[str, Any]] = field(default_factory=dict)
    json_out: Path | None = None
    prompts: dict[str, Any] = field(default_factory=dict)  # query / document prompt and where each came from

    def to_dict(self) -> dict[str, Any]:
        """The JSON report: model, model_fingerprint, max_seq_length, device, split, sets, prompts."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "json_out"}


def score_model(
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
    progress: EncodeProgress | None = None,
) -> EvalReport:
    """Load the sets and the model (:func:`prepare_eval`), score it and, with ``json_out``, write the
    report as JSON (atomically). Prints nothing.

    ``cache_dir`` is the cache root (default :func:`cembed.files.cache_root`'s); the corpus embeddings go
    to its ``embeddings`` folder, none with ``no_cache``. ``progress(set_name, n_documents)``,
    when given, returns a context manager entered around each retrieval set's scoring; it yields a
    ``(done, total)`` callback for the corpus encoding (or None).

    Returns:
        An :class:`EvalReport`; ``report.to_dict()`` is what ``json_out`` holds.

    Raises:
        UserError: see :func:`prepare_eval`.
    """
    setup = prepare_eval(model_name, retrieval, sts, split, json_out, max_seq_length, device, cache_dir, no_cache)
    model, prompts = setup.model, setup.prompts
    shown = {"query": prompts.to_dict()["anchor"], "document": prompts.to_dict()["positive"]}
    report = EvalReport(model_name, setup.fingerprint, model.max_seq_length, str(model.device), split, prompts=shown)
    for rs in setup.retrieval:
        with setup.progress_for(progress, rs) as on_progress:
            metrics, ce = evaluate_retrieval(
                model, rs, batch_size, setup.cache, on_progress, setup.fingerprint, prompts
            )
        report.sets[rs.name] = {
            "kind": "retrieval",
            "path": rs.path,
            "split": rs.split,
            "queries": len(rs.queries),
            "documents": len(rs.corpus),
            "headline": headline(metrics, rs.name, "retrieval", scored_by(model)),
            "metrics": metrics,
            "corpus_cache": ce.cache_file,
            "corpus_cache_hit": ce.cache_hit,
            "encode_seconds": round(ce.encode_seconds, 2),
        }
    for ss in setup.sts:
        metrics = evaluate_sts(model, ss, batch_size)
        report.sets[ss.name] = {
            "kind": "sts",
            "path": ss.path,
            "pairs": len(ss.scores),
            "headline": headline(metrics, ss.name, "sts"),
            "metrics": metrics,
        }
    _write_json(report, json_out)
    return report


# ----------------------------------------------------------------------------------------------
# --dims: truncated embeddings


@dataclass
class DimsReport:
    """Headline metrics per truncation: ``scores[dim][set name] = {label: value}``."""

    model: str
    full_dim: int
    scores: dict[int, dict[str, dict[str, float]]] = field(default_factory=dict)
    json_out: Path | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON report: model, full_dim, scores (keyed by the size as text)."""
        return {"model": self.model, "full_dim": self.full_dim, "scores": {str(d): s for d, s in self.scores.items()}}


def parse_dims(text: str) -> list[int]:
    """``"384,128,64"`` -> ``[384, 128, 64]``.

    Raises:
        UserError: not a comma-separated list of positive integers (naming ``--dims``).
    """
    try:
        dims = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        dims = []
    if not dims or min(dims) <= 0:
        raise UserError(f"--dims {text!r}: give embedding sizes as positive integers, e.g. --dims 384,128,64")
    return dims


def score_dims(
    model_name: str,
    retrieval: list[Path],
    sts: list[Path],
    dims: list[int],
    split: str = "test",
    batch_size: int = 32,
    max_seq_length: int | None = None,
    device: str = "auto",
    cache_dir: Path | None = None,
    no_cache: bool = False,
    json_out: Path | None = None,
    progress: EncodeProgress | None = None,
) -> DimsReport:
    """Score ``model_name`` on every set at each size in ``dims`` (headline metrics, as ``cembed eval``)
    and, with ``json_out``, write the report there (atomically). The setup, the checks, the prompts and
    the corpus-cache entry are :func:`score_model`'s (:func:`prepare_eval`); ``progress`` as there.

    Raises:
        UserError: a size larger than the model's embeddings (naming ``--dims``), or see :func:`prepare_eval`.
    """
    import torch

    setup = prepare_eval(model_name, retrieval, sts, split, json_out, max_seq_length, device, cache_dir, no_cache)
    model, prompts = setup.model, setup.prompts
    if similarity_of(model) != "cosine":
        raise UserError(
            f"--dims: {model_name} is not a dense model (it scores by {scored_by(model)}); --dims truncates one vector per text"
        )
    full = model.get_embedding_dimension()
    if max(dims) > full:
        raise UserError(f"--dims {','.join(map(str, dims))}: the model's embeddings have {full} dimensions")
    report = DimsReport(model_name, full)
    corpora = {}
    for rs in setup.retrieval:  # full size, under the key score_model uses
        with setup.progress_for(progress, rs) as on_progress:
            ce = corpus_embeddings(
                model, rs.corpus, batch_size, setup.cache, on_progress, setup.fingerprint, prompts.positive
            )
        corpora[rs.name] = ce.embeddings
    try:
        for dim in dims:
            model.truncate_dim = None if dim == full else dim
            scores = report.scores.setdefault(dim, {})
            for rs in setup.retrieval:
                emb = torch.from_numpy(corpora[rs.name][:, :dim]).to(model.device)
                metrics = retrieval_evaluator(rs, batch_size, prompts=prompts)(model, corpus_embeddings=emb)
                scores[rs.name] = headline(
                    {k: float(v) for k, v in metrics.items()}, rs.name, "retrieval", scored_by(model)
                )
            for ss in setup.sts:
                scores[ss.name] = headline(evaluate_sts(model, ss, batch_size), ss.name, "sts")
    finally:
        model.truncate_dim = None
    _write_json(report, json_out)
    return report
