"""``cembed eval --dims 384,128,64``: the same sets scored on truncated embeddings (the first ``d``
dimensions; cosine similarity normalizes them), as a Matryoshka-trained model is used (Kusupati et al.
2022, arXiv:2205.13147).

Queries and STS sentences are encoded through sentence-transformers' ``truncate_dim``; the corpus is
encoded (or read from the cache) once at full size and sliced, so the cache keeps full-size embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cembed.errors import UserError
from cembed.eval.embedding_cache import corpus_embeddings
from cembed.eval.evaluators import evaluate_sts, headline, retrieval_evaluator
from cembed.eval.sets import load_beir, load_sts
from cembed.files import cache_root
from cembed.model.fingerprint import model_fingerprint
from cembed.model.load import load_eval_model


@dataclass
class DimsReport:
    """Headline metrics per truncation: ``scores[dim][set name] = {label: value}``."""

    model: str
    full_dim: int
    scores: dict[int, dict[str, dict[str, float]]] = field(default_factory=dict)
    json_out: Path | None = None

    def to_dict(self) -> dict[str, Any]:
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
) -> DimsReport:
    """Score ``model_name`` on every set at each size in ``dims`` (headline metrics, as ``cembed eval``)
    and, with ``json_out``, write the report there (atomically).

    Raises:
        UserError: no set, a size larger than the model's embeddings (naming ``--dims``), or any
            loader/model error.
    """
    import torch

    if not retrieval and not sts:
        raise UserError("cembed eval: give at least one --retrieval FOLDER or --sts FILE")
    rsets = [load_beir(p, split) for p in retrieval]
    ssets = [load_sts(p) for p in sts]
    model = load_eval_model(model_name, device, max_seq_length)
    full = model.get_embedding_dimension()
    if max(dims) > full:
        raise UserError(f"--dims {','.join(map(str, dims))}: the model's embeddings have {full} dimensions")
    fp = model_fingerprint(model)
    cache = None if no_cache else cache_root("embeddings", cache_dir)
    report = DimsReport(model_name, full)
    corpora = {rs.name: corpus_embeddings(model, rs.corpus, batch_size, cache, None, fp).embeddings for rs in rsets}
    try:
        for dim in dims:
            model.truncate_dim = None if dim == full else dim
            scores = report.scores.setdefault(dim, {})
            for rs in rsets:
                emb = torch.from_numpy(corpora[rs.name][:, :dim]).to(model.device)
                metrics = retrieval_evaluator(rs, batch_size)(model, corpus_embeddings=emb)
                scores[rs.name] = headline({k: float(v) for k, v in metrics.items()}, rs.name, "retrieval")
            for ss in ssets:
                scores[ss.name] = headline(evaluate_sts(model, ss, batch_size), ss.name, "sts")
    finally:
        model.truncate_dim = None
    if json_out is not None:
        from cembed.files import write_json_atomic

        write_json_atomic(json_out, report.to_dict())
        report.json_out = json_out
    return report
