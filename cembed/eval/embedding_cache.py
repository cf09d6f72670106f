"""The on-disk cache of corpus embeddings, keyed by model and corpus fingerprints.

A retrieval corpus is encoded once per (model, corpus): the cache file is named by
:func:`cembed.model.fingerprint.model_fingerprint` (weights, module stack, max_seq_length, tokenizer,
prompts, device type) and :func:`corpus_fingerprint` (document ids and texts in order, the prompt),
salted with :data:`CACHE_FORMAT` (:func:`cache_path`), so any change misses and the same model on the
same corpus never re-encodes. Files are float32 ``.npy`` arrays ``(documents, dim)`` written atomically, in
:func:`cembed.files.cache_root` ``("embeddings", ...)``; a model that makes token vectors (a multi-vector
model: ``encode_document`` gives one ``(tokens, dim)`` array per document) is cached ragged, without
padding, as ``.npz`` with ``values`` (every document's tokens end to end, float32) and ``offsets``
(int64, documents + 1); a model that makes sparse vectors (a sparse model: ``encode_document`` gives a
sparse tensor) is cached as CSR, ``.csr.npz`` with ``indptr`` (int64, documents + 1), ``indices`` (int32,
the active coordinates of every document end to end), ``values`` (float32, theirs) and ``width`` (the
vectors' dimension): a trained SPLADE document's ~200 active coordinates take ~1.6 KB instead of the
122 KB of a dense 30,522-wide row. How a model's kind encodes its corpus:
:meth:`cembed.model.kinds.registry.ModelKind.corpus_encode_kwargs`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cembed.errors import UserError
from cembed.model.fingerprint import model_fingerprint

# Bumped whenever the way documents are turned into text or encoded changes, so old caches miss.
CACHE_FORMAT = "cembed-corpus-v1"


def _hasher():
    import xxhash

    return xxhash.xxh3_128()


def corpus_fingerprint(corpus: dict[str, str], prompt: str | None = None) -> str:
    """A hash of the documents as encoded: ids and texts in order, and the ``prompt`` prepended to
    each when one is given (None: the model's own document prompt, covered by the model fingerprint);
    32 hex characters, xxh3-128."""
    h = _hasher()
    if prompt is not None:
        h.update(b"prompt\x00" + prompt.encode() + b"\x01")
    for doc_id, text in corpus.items():
        h.update(doc_id.encode())
        h.update(b"\x00")
        h.update(text.encode())
        h.update(b"\x01")
    return h.hexdigest()


def cache_path(cache_dir: str | Path, model_fp: str, corpus_fp: str) -> Path:
    """Where the corpus embeddings for (model, corpus) live: ``<cache_dir>/<model_fp>-<key>.npy``, ``key``
    the xxh3-128 of :data:`CACHE_FORMAT` and ``corpus_fp`` (so a format change misses every old entry;
    one model's entries share the file-name prefix). ``cache_dir``: the embeddings folder,
    :func:`cembed.files.cache_root` ``("embeddings", ...)``."""
    h = _hasher()
    h.update(f"{CACHE_FORMAT}|{corpus_fp}".encode())
    return Path(cache_dir) / f"{model_fp}-{h.hexdigest()}.npy"


def _save_npy_atomic(path: Path, array: np.ndarray) -> None:
    from cembed.files import write_atomic

    write_atomic(path, lambda f: np.save(f, array), binary=True)


def ragged_path(path: Path) -> Path:
    """The ragged cache file beside the one-vector file ``path`` (:func:`cache_path`)."""
    return path.with_suffix(".npz")


def _save_ragged_atomic(path: Path, values: np.ndarray, offsets: np.ndarray) -> None:
    from cembed.files import write_atomic

    write_atomic(path, lambda f: np.savez(f, values=values, offsets=offsets), binary=True)


def _load_ragged(path: Path, rows: int, dim: int | None) -> tuple[np.ndarray, np.ndarray] | None:
    """``(values, offsets)`` of a ragged cache file if it reads and fits ``rows`` documents, else None."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as stored:
            values, offsets = stored["values"], stored["offsets"]
    except (OSError, ValueError, EOFError, KeyError):
        return None
    fits = offsets.shape == (rows + 1,) and values.ndim == 2 and int(offsets[-1]) == values.shape[0]
    if not fits or values.dtype != np.float32 or (dim is not None and values.shape[1] != dim):
        return None
    return values, offsets


def sparse_path(path: Path) -> Path:
    """The CSR cache file beside the one-vector file ``path`` (:func:`cache_path`)."""
    return path.with_suffix(".csr.npz")


@dataclass(frozen=True)
class CsrRows:
    """Sparse vectors in CSR form: row ``i``'s active coordinates are ``indices[indptr[i]:indptr[i + 1]]``
    (int32, ascending) with ``values`` (float32) there; ``width`` is the vectors' dimension."""

    indptr: np.ndarray
    indices: np.ndarray
    values: np.ndarray
    width: int

    @classmethod
    def from_rows(cls, rows: list[tuple[np.ndarray, np.ndarray]], width: int) -> CsrRows:
        """From one ``(indices, values)`` pair per row, in row order."""
        indptr = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum([len(i) for i, _ in rows], out=indptr[1:])
        indices = np.concatenate([i for i, _ in rows]).astype(np.int32, copy=False) if rows else np.zeros(0, np.int32)
        values = (
            np.concatenate([v for _, v in rows]).astype(np.float32, copy=False) if rows else np.zeros(0, np.float32)
        )
        return cls(indptr, indices, values, int(width))

    def fits(self, rows: int, dim: int | None) -> bool:
        """Whether these are ``rows`` vectors of width ``dim`` (None: any), with consistent arrays."""
        return (
            self.indptr.shape == (rows + 1,)
            and int(self.indptr[0]) == 0
            and bool(np.all(np.diff(self.indptr) >= 0))
            and self.indices.shape == self.values.shape == (int(self.indptr[-1]),)
            and self.indices.dtype == np.int32
            and self.values.dtype == np.float32
            and (dim is None or self.width == dim)
            and (len(self.indices) == 0 or 0 <= int(self.indices.min()) <= int(self.indices.max()) < self.width)
        )


def sparse_tensor_rows(tensor) -> list[tuple[np.ndarray, np.ndarray]]:
    """One ``(indices int32, values float32)`` pair per row of a 2-d torch sparse tensor (COO or CSR), its
    active coordinates in ascending order (explicit zeros left out)."""
    import torch

    tensor = tensor.detach().cpu()
    csr = tensor if tensor.layout == torch.sparse_csr else tensor.coalesce().to_sparse_csr()
    indptr = csr.crow_indices().numpy().astype(np.int64)
    indices = csr.col_indices().numpy().astype(np.int32)
    values = csr.values().float().numpy()
    out = []
    for a, b in zip(indptr[:-1], indptr[1:]):
        keep = values[a:b] != 0
        out.append((indices[a:b][keep], values[a:b][keep]))
    return out


def _save_sparse_atomic(path: Path, rows: CsrRows) -> None:
    from cembed.files import write_atomic

    arrays = {"indptr": rows.indptr, "indices": rows.indices, "values": rows.values, "width": np.int64(rows.width)}
    write_atomic(path, lambda f: np.savez(f, **arrays), binary=True)


def _load_sparse(path: Path, rows: int, dim: int | None) -> CsrRows | None:
    """The CSR cache file's rows if it reads and fits ``rows`` documents of width ``dim``, else None."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as stored:
            csr = CsrRows(stored["indptr"], stored["indices"], stored["values"], int(stored["width"]))
    except (OSError, ValueError, EOFError, KeyError, TypeError):
        return None
    return csr if csr.fits(rows, dim) else None


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


def encode_documents(
    model, texts: list[str], batch_size: int = 32, progress: ProgressFn | None = None, prompt: str | None = None
) -> np.ndarray | tuple[np.ndarray, np.ndarray] | CsrRows:
    """Encode ``texts`` with ``model.encode_document`` (``prompt`` prepended; None: the model's
    document prompt) as the model's kind encodes a corpus
    (:meth:`cembed.model.kinds.registry.ModelKind.corpus_encode_kwargs`); returns float32
    ``(len(texts), dim)``, or for a model of token vectors ``(values, offsets)``: every text's
    ``(tokens, dim)`` vectors end to end and int64 row offsets, or for a model of sparse vectors
    :class:`CsrRows`.

    Texts are sorted by length (longest first, as ``encode`` does internally) and encoded in chunks
    of ``batch_size * 8`` so ``progress(done, total)`` can be reported; the output is in input order.
    Padding is masked, so chunking does not change the embeddings beyond float rounding.
    """
    from cembed.model.kinds.lookup import kind_of

    options = kind_of(model, default="dense").corpus_encode_kwargs()
    order = np.argsort([-len(t) for t in texts], kind="stable")
    rows: list = [None] * len(texts)  # a token-vector or sparse model's per-text arrays
    out: np.ndarray | None = None
    width = None  # a sparse model's vector width
    chunk = batch_size * 8
    done = 0
    if progress:
        progress(0, len(texts))
    for start in range(0, len(texts), chunk):
        idx = order[start : start + chunk]
        emb = model.encode_document(
            [texts[i] for i in idx], batch_size=batch_size, show_progress_bar=False, prompt=prompt, **options
        )
        done += len(idx)
        if getattr(emb, "is_sparse", False) or str(getattr(emb, "layout", "")) == "torch.sparse_csr":
            width = int(emb.shape[1])
            for i, row in zip(idx, sparse_tensor_rows(emb)):
                rows[i] = row
        elif isinstance(emb, list):  # one (tokens, dim) array per text
            for i, tokens in zip(idx, emb):
                rows[i] = np.asarray(tokens, dtype=np.float32)
        else:
            emb = emb.astype(np.float32, copy=False)
            if out is None:
                out = np.empty((len(texts), emb.shape[1]), dtype=np.float32)
            out[idx] = emb
        if progress:
            progress(done, len(texts))
    if width is not None:
        return CsrRows.from_rows(rows, width)
    if out is None and texts:
        offsets = np.zeros(len(texts) + 1, dtype=np.int64)
        np.cumsum([len(r) for r in rows], out=offsets[1:])
        return np.concatenate(rows).astype(np.float32, copy=False), offsets
    assert out is not None
    return out


@dataclass
class CorpusEmbeddings:
    """Corpus embeddings plus where they came from."""

    embeddings: np.ndarray  # float32 (n_docs, dim), in corpus order; ragged: every document's tokens end to end;
    # CSR: every document's active values end to end
    cache_file: str | None
    cache_hit: bool
    encode_seconds: float
    offsets: np.ndarray | None = None  # ragged (token vectors) or CSR (indptr): int64 (n_docs + 1), document i's rows
    indices: np.ndarray | None = None  # CSR (sparse vectors): int32, each value's coordinate
    width: int | None = None  # CSR: the sparse vectors' dimension

    @classmethod
    def of(cls, emb, cache_file: str | None, cache_hit: bool, seconds: float) -> CorpusEmbeddings:
        """From what :func:`encode_documents` returns (an array, ``(values, offsets)`` or :class:`CsrRows`)."""
        if isinstance(emb, CsrRows):
            return cls(emb.values, cache_file, cache_hit, seconds, emb.indptr, emb.indices, emb.width)
        values, offsets = emb if isinstance(emb, tuple) else (emb, None)
        return cls(values, cache_file, cache_hit, seconds, offsets)

    def on_device(self, device):
        """What an evaluator takes as ``corpus_embeddings`` on ``device``: a ``(n_docs, dim)`` tensor, one
        ``(tokens, dim)`` tensor per document, or (CSR) a ``(n_docs, width)`` sparse COO tensor (what
        sentence-transformers' sparse evaluators take)."""
        import torch

        values = torch.from_numpy(self.embeddings).to(device)
        if self.indices is not None:
            rows = np.repeat(np.arange(len(self.offsets) - 1), np.diff(self.offsets))
            coordinates = torch.from_numpy(np.stack([rows, self.indices.astype(np.int64)]))
            size = (len(self.offsets) - 1, self.width)
            coo = torch.sparse_coo_tensor(coordinates, values.cpu(), size, check_invariants=True)
            return coo.coalesce().to(device)
        if self.offsets is None:
            return values
        return [values[a:b] for a, b in zip(self.offsets[:-1].tolist(), self.offsets[1:].tolist())]


def _embedding_dimension(model) -> int | None:
    """The width of one stored vector, as the model's kind knows it
    (:meth:`cembed.model.kinds.registry.ModelKind.embedding_dimension`: a SPLADE model's vocabulary even before
    its first forward, when sentence-transformers still answers its hidden size); None where the object has
    no such method (a stand-in model)."""
    from cembed.model.kinds.lookup import kind_of

    try:
        return kind_of(model, default="dense").embedding_dimension(model)
    except AttributeError:
        return None


def corpus_embeddings(
    model,
    corpus: dict[str, str],
    batch_size: int = 32,
    cache_dir: str | Path | None = None,
    progress: ProgressFn | None = None,
    model_fp: str | None = None,
    prompt: str | None = None,
) -> CorpusEmbeddings:
    """Embeddings of every corpus document, read from / written to the on-disk cache.

    The cache file (:func:`cache_path` in ``cache_dir``, the embeddings folder) is keyed by ``model_fp``
    (default :func:`cembed.model.fingerprint.model_fingerprint`) and :func:`corpus_fingerprint` (with the
    ``prompt``), so a changed weight, tokenizer, max_seq_length, prompt or document misses, and the
    same model on the same corpus never re-encodes. ``cache_dir=None`` disables the cache. A corrupt
    or mis-shaped cache file is ignored and rewritten. Writes are atomic.
    """
    texts = list(corpus.values())
    path = None
    if cache_dir is not None:
        path = cache_path(cache_dir, model_fp or model_fingerprint(model), corpus_fingerprint(corpus, prompt))
        dim = _embedding_dimension(model)
        for found, load in ((path, _load_cached), (ragged_path(path), _load_ragged), (sparse_path(path), _load_sparse)):
            stored = load(found, len(texts), dim)
            if stored is not None:
                if progress:
                    progress(len(texts), len(texts))
                return CorpusEmbeddings.of(stored, str(found), True, 0.0)
    t0 = time.perf_counter()
    emb = encode_documents(model, texts, batch_size, progress, prompt)
    seconds = time.perf_counter() - t0
    if path is not None:
        if isinstance(emb, CsrRows):
            path, save = sparse_path(path), lambda p: _save_sparse_atomic(p, emb)
        elif isinstance(emb, tuple):
            path, save = ragged_path(path), lambda p: _save_ragged_atomic(p, *emb)
        else:
            save = lambda p: _save_npy_atomic(p, emb)  # noqa: E731
        try:
            save(path)
        except OSError as err:
            raise UserError(
                f"{path.parent}: cannot write the embedding cache ({err}); use another --cache-dir or --no-cache"
            ) from None
    return CorpusEmbeddings.of(emb, str(path) if path else None, False, seconds)
