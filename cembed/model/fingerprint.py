"""Fingerprints of a loaded model and its tokenizer: the keys of every on-disk cache.

- :func:`tokenizer_spec` is the tokenizer's definition without its per-call state;
  :func:`tokenizer_fingerprint` hashes it (the pre-tokenized data's key, :mod:`cembed.data.tokens.tokenize`).
- :func:`model_fingerprint` hashes everything that decides a SentenceTransformer's embeddings (the
  corpus-embedding cache of :mod:`cembed.eval.embedding_cache` and ``mine-negatives``' cache folder,
  :mod:`cembed.data.mining`). A cache's own format version is mixed in by that cache, not here.
"""

from __future__ import annotations

import json

import xxhash


def tokenizer_spec(tokenizer) -> str:
    """The tokenizer's definition as canonical JSON text: the fast tokenizer's full JSON (vocab,
    normalizer, special tokens, post-processor) without its ``truncation``/``padding`` entries, which
    record the last call rather than the tokenizer; for a ``tokenizers.Tokenizer`` used as it is
    (StaticEmbedding's), its JSON with ``truncation`` (its own limit, applied to every text the module
    embeds) and without ``padding``; for a slow tokenizer, its sorted vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None and hasattr(tokenizer, "to_str"):
        spec = {k: v for k, v in json.loads(tokenizer.to_str()).items() if k != "padding"}
        return json.dumps(spec, sort_keys=True)
    if backend is None:
        return json.dumps(sorted(tokenizer.get_vocab().items()))
    spec = {k: v for k, v in json.loads(backend.to_str()).items() if k not in ("truncation", "padding")}
    return json.dumps(spec, sort_keys=True)


def tokenizer_fingerprint(tokenizer) -> str:
    """xxh64 of the tokenizer's definition (:func:`tokenizer_spec`: vocab, normalizer, special tokens,
    post-processor; not the state of its last call); 16 hex characters."""
    return xxhash.xxh64_hexdigest(tokenizer_spec(tokenizer).encode("utf-8"))


def model_fingerprint(model) -> str:
    """A hash of everything that decides a SentenceTransformer's embeddings.

    Covers every weight (name, dtype, shape, bytes), the module stack as printed (pooling mode,
    normalisation), max_seq_length, the tokenizer (vocabulary and rules, not its last
    padding/truncation state), the prompts, the device type and what the model's kind says changes its
    encoding beyond those (:meth:`cembed.model.kinds.registry.ModelKind.encode_settings`: a sparse model's
    ``max_active_dims``). Two loads of the same saved model give the same fingerprint; any weight change
    gives another.

    Returns:
        32 hex characters (xxh3-128).
    """
    import torch

    h = xxhash.xxh3_128()
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
    settings = _encode_settings(model)
    if settings:  # none for a dense model: its fingerprints (and cache entries) stay as they were
        h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    return h.hexdigest()


def _encode_settings(model) -> dict:
    from cembed.model.kinds.lookup import kind_of

    try:
        return kind_of(model, default="dense").encode_settings(model)
    except AttributeError:  # a stand-in object without what its kind reads
        return {}
