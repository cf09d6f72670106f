"""``cembed eval``: score a saved model on BEIR retrieval folders and STS files (:func:`score_model`).

The sets come from :mod:`cembed.eval.sets`, the metrics from :mod:`cembed.eval.evaluators` (sentence-transformers'
evaluators), the corpus embeddings from :mod:`cembed.eval.embedding_cache`. Retrieval queries get the
model's query prompt and corpora its document prompt (:func:`cembed.model.prompts.resolve_prompts` with no
``data.prompts``: the same rule as training), so the numbers are those of the model as it is used.
Nothing here prints; :mod:`cembed.cli.eval` shows the :class:`EvalReport`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from cembed.errors import UserError
from cembed.eval.embedding_cache import ProgressFn, default_cache_dir, model_fingerprint
from cembed.eval.evaluators import evaluate_retrieval, evaluate_sts, headline
from cembed.eval.sets import load_beir, load_sts
from cembed.model.load import load_eval_model
from cembed.model.prompts import resolve_prompts

# (set name, n_documents) -> a context manager giving the (done, total) encode callback:
EncodeProgress = Callable[[str, int], AbstractContextManager[ProgressFn | None]]


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
    """Load the sets and the model, score it and, with ``json_out``, write the report as JSON
    (atomically). Prints nothing.

    Data is loaded before the model, so a wrong path fails fast. The corpus cache is ``cache_dir`` or
    :func:`~cembed.eval.embedding_cache.default_cache_dir`, none with ``no_cache``. ``progress(set_name, n_documents)``,
    when given, returns a context manager entered around each retrieval set's scoring; it yields a
    ``(done, total)`` callback for the corpus encoding (or None).

    Returns:
        An :class:`EvalReport`; ``report.to_dict()`` is what ``json_out`` holds.

    Raises:
        UserError: no set given, ``json_out`` a folder, two sets with the same name, or any
            loader/model error (see :func:`~cembed.eval.sets.load_beir`,
            :func:`~cembed.eval.sets.load_sts`, :func:`~cembed.model.load.load_eval_model`).
    """
    from cembed.files import write_json_atomic
    from cembed.model.load import quiet_libraries

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
    prompts = resolve_prompts(None, model)
    shown = {"query": prompts.to_dict()["anchor"], "document": prompts.to_dict()["positive"]}
    report = EvalReport(model_name, fp, model.max_seq_length, str(model.device), split, prompts=shown)
    for rs in rsets:
        bar = progress(rs.name, len(rs.corpus)) if progress else contextlib.nullcontext(None)
        with bar as on_progress:
            metrics, ce = evaluate_retrieval(model, rs, batch_size, cache, on_progress, fp, prompts)
        report.sets[rs.name] = {
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
        report.sets[ss.name] = {
            "kind": "sts",
            "path": ss.path,
            "pairs": len(ss.scores),
            "headline": headline(metrics, ss.name, "sts"),
            "metrics": metrics,
        }
    if json_out is not None:
        write_json_atomic(json_out, report.to_dict())
        report.json_out = json_out
    return report
