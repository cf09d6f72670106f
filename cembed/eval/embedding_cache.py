"""The on-disk cache of corpus embeddings, keyed by model and corpus fingerprints.

A retrieval corpus is encoded once per (model, corpus): the cache file is named by
:func:`cembed.model.fingerprint.model_fingerprint` (weights, module stack, max_seq_length, tokenizer,
prompts, device type) and :func:`corpus_fingerprint` (document ids and texts in order, the prompt),
salted with :data:`CACHE_FORMAT` (:func:`cache_path`), so any change misses and the same model on the
same corpus never re-encodes. Files are float32 ``.npy`` arrays ``(documents, dim)`` written atomically, in
:func:`cembed.files.cache_root` ``("embeddings", ...)``; a model that makes token vectors (a multi-vector
model: ``encode_document`` gives one ``(tokens, dim)`` array per document) is cached ragged, without
padding, as ``.npz`` with ``values`` (every document's tokens end to end, float32) and ``offsets``
(int64, documents + 1).
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
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Encode ``texts`` with ``model.encode_document`` (``prompt`` prepended; None: the model's
    document prompt); returns float32 ``(len(texts), dim)``, or for a model of token vectors
    ``(values, offsets)``: every text's ``(tokens, dim)`` vectors end to end and int64 row offsets.

    Texts are sorted by length (longest first, as ``encode`` does internally) and encoded in chunks
    of ``batch_size * 8`` so ``progress(done, total)`` can be reported; the output is in input order.
    Padding is masked, so chunking does not change the embeddings beyond float rounding.
    """
    order = np.argsort([-len(t) for t in texts], kind="stable")
    rows: list[np.ndarray | None] = [None] * len(texts)  # a token-vector model's per-text arrays
    out: np.ndarray | None = None
    chunk = batch_size * 8
    done = 0
    if progress:
        progress(0, len(texts))
    for start in range(0, len(texts), chunk):
        idx = order[start : start + chunk]
        emb = model.encode_document(
            [texts[i] for i in idx],
            batch_size=batch_size,
            convert_to_numpy=True,
            show_progress_bar=False,
            prompt=prompt,
        )
        done += len(idx)
        if isinstance(emb, list):  # one (tokens, dim) array per text
            for i, tokens in zip(idx, emb):
                rows[i] = np.asarray(tokens, dtype=np.float32)
        else:
            emb = emb.astype(np.float32, copy=False)
            if out is None:
                out = np.empty((len(texts), emb.shape[1]), dtype=np.float32)
            out[idx] = emb
        if progress:
            progress(done, len(texts))
    if out is None and texts:
        offsets = np.zeros(len(texts) + 1, dtype=np.int64)
        np.cumsum([len(r) for r in rows], out=offsets[1:])
        return np.concatenate(rows).astype(np.float32, copy=False), offsets
    assert out is not None
    return out


@dataclass
class CorpusEmbeddings:
    """Corpus embeddings plus where they came from."""

    embeddings: np.ndarray  # float32 (n_docs, dim), in corpus order; ragged: every document's tokens end to end
    cache_file: str | None
    cache_hit: bool
    encode_seconds: float
    offsets: np.ndarray | None = None  # ragged (token vectors): int64 (n_docs + 1), document i's rows

    def on_device(self, device):
        """What an evaluator takes as ``corpus_embeddings`` on ``device``: a ``(n_docs, dim)`` tensor, or
        one ``(tokens, dim)`` tensor per document."""
        import torch

        values = torch.from_numpy(self.embeddings).to(device)
        if self.offsets is None:
            return values
        return [values[a:b] for a, b in zip(self.offsets[:-1].tolist(), self.offsets[1:].tolist())]


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
        get_dim = getattr(model, "get_embedding_dimension", None) or getattr(
            model, "get_sentence_embedding_dimension", None
        )
        dim = get_dim() if get_dim else None
        cached = _load_cached(path, len(texts), dim)
        stored = _load_ragged(ragged_path(path), len(texts), dim) if cached is None else None
        if cached is not None or stored is not None:
            if progress:
                progress(len(texts), len(texts))
            if cached is not None:
                return CorpusEmbeddings(cached, str(path), True, 0.0)
            return CorpusEmbeddings(stored[0], str(ragged_path(path)), True, 0.0, stored[1])
    t0 = time.perf_counter()
    emb = encode_documents(model, texts, batch_size, progress, prompt)
    seconds = time.perf_counter() - t0
    values, offsets = emb if isinstance(emb, tuple) else (emb, None)
    if path is not None:
        path = path if offsets is None else ragged_path(path)
        try:
            if offsets is None:
                _save_npy_atomic(path, values)
            else:
                _save_ragged_atomic(path, values, offsets)
        except OSError as err:
            raise UserError(
                f"{path.parent}: cannot write the embedding cache ({err}); use another --cache-dir or --no-cache"
            ) from None
    return CorpusEmbeddings(values, str(path) if path else None, False, seconds, offsets)
