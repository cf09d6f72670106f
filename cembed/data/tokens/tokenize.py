"""Pre-tokenization: tokenize every text column once, cache it on disk, pad in the collator.

Tokenizing 16k pairs per batch in the main process stalls a fast GPU for seconds; padding ids that
were tokenized ahead of time takes milliseconds. :func:`pretokenize` adds a ``<role>_input_ids``
column (int32 lists, special tokens included, truncated to ``max_seq_length``) next to each text
column, with the model's own fast tokenizer, batched and in several processes. The result is saved
under the cache folder keyed by the data's fingerprint, the tokenizer and ``max_seq_length``, so a
later run with the same inputs loads it instead of tokenizing again.

The batches are then fetched and padded by :mod:`cembed.data.tokens.collator` (:class:`~cembed.data.tokens.collator.TokenIdRows`,
:class:`~cembed.data.tokens.collator.PaddingCollator`), which only pads and stacks the stored ids.

Equivalence with sentence-transformers' own preprocessing (special tokens, lower-casing,
truncation) is checked on real rows before training (:func:`cembed.data.tokens.model_check.matches_model_preprocessing`); where it
does not hold, the caller falls back to tokenizing in the collator.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from cembed.data.tokens.collator import collator_for
from cembed.data.tokens.encode import SourcePrompts, id_features, prompt_groups, tokenize_into
from cembed.data.tokens.model_check import matches_model_preprocessing, prepared_stage
from cembed.files import cache_root, file_lock
from cembed.model.fingerprint import tokenizer_fingerprint
from cembed.model.prompts import prompt_lengths

# Bump when the stored layout changes, so old caches are not reused.
FORMAT_VERSION = "3"  # 2: only the new columns, the map's own files, a manifest; 3: <role>_hash


def cache_key(
    data_fingerprint: str, tokenizer, max_seq_length: int, roles: list[str], prompts: dict | None = None
) -> str:
    """The cache folder name for one (data, tokenizer, max_seq_length, columns, prompts) combination."""
    parts = [FORMAT_VERSION, data_fingerprint, tokenizer_fingerprint(tokenizer), str(max_seq_length), ",".join(roles)]
    if prompts:  # absent for no prompts, so caches made before prompts existed stay valid
        parts.append(json.dumps(prompts, sort_keys=True))
    return xxhash.xxh64_hexdigest("|".join(parts).encode("utf-8"))


@dataclass
class Pretokenized:
    """A dataset with ``<role>`` text and ``<role>_input_ids`` columns, and where it came from."""

    dataset: Any
    roles: list[str]
    cache_path: Path | None
    from_cache: bool


# The file that completes a cache entry: the tokenized parts' file names in row order, the row count,
# the features (an empty set has no part) and whether the texts are kept. It is written into the temporary folder before the folder is renamed into place, so an
# entry without it (or an unreadable one) is never used.
MANIFEST = "cembed_tokenized.json"


def read_entry(path: str | Path):
    """The columns a published cache entry stores (``<role>_input_ids``, ``<role>_hash``, ``<role>_prompt_length``;
    the texts too where it keeps them), memory-mapped, in row order.

    Raises:
        FileNotFoundError: ``path`` is not a complete entry (no manifest).
        ValueError: the parts' row count differs from the manifest's.
    """
    from datasets import Dataset, Features, concatenate_datasets

    path = Path(path)
    manifest = json.loads((path / MANIFEST).read_text())
    parts = [Dataset.from_file(str(path / name)) for name in manifest["files"]]
    if not parts:  # no rows: map wrote no file
        features = Features.from_dict(manifest["features"])
        return Dataset.from_dict({c: [] for c in features}, features=features)
    stored = parts[0] if len(parts) == 1 else concatenate_datasets(parts)
    if stored.num_rows != manifest["rows"]:
        raise ValueError(f"{path}: {stored.num_rows} rows stored, the manifest says {manifest['rows']}")
    return stored


def _load_entry(path: Path, dataset):
    """The published entry at ``path`` joined to ``dataset``'s columns, or None (absent, or damaged:
    then removed, so it is rebuilt rather than trusted)."""
    from datasets import concatenate_datasets

    if not (path / MANIFEST).exists():
        return None
    try:
        stored = read_entry(path)
        if len(stored) != len(dataset):
            raise ValueError("row count")
        if set(dataset.column_names) <= set(stored.column_names):  # the texts are kept in the entry
            return stored
        return concatenate_datasets([dataset, stored], axis=1)
    except Exception:
        shutil.rmtree(path, ignore_errors=True)
        return None


def pretokenize(
    dataset,
    roles: list[str],
    tokenizer,
    max_seq_length: int,
    cache_dir: str | Path | None = None,
    num_proc: int | str | None = None,
    prompts: dict[str, str] | None = None,
    prompt_lengths: dict[str, int] | None = None,
    sources: list[SourcePrompts] | None = None,
    progress=None,
) -> Pretokenized:
    """Tokenize each role column once (or load the cached result). A null cell (a source that does
    not map the column) stays null.

    The entry is written once: datasets' ``map`` writes the id columns straight into a temporary
    folder of the cache (no copy in datasets' own cache), which is renamed into place when complete.
    It holds only the new columns (``<role>_input_ids``, ``<role>_hash``, ``<role>_prompt_length``;
    ``<role>_hash`` is :func:`cembed.data.identity.hash_token_ids` of the ids without the prompt's
    tokens, uint64, null for a null cell, computed inside the map): the texts are
    joined from ``dataset`` when loaded (kept in the entry only when ``dataset`` has an indices
    mapping, which a column join would rewrite). One process writes an entry at a time (a file lock);
    the next one loads it. A run killed while tokenizing leaves only its temporary folder, removed
    by the next writer.

    Args:
        dataset: a ``datasets.Dataset`` with one text column per role.
        roles: the text columns, in loss order.
        tokenizer: the model's (fast) tokenizer.
        max_seq_length: truncation length in tokens, special tokens included.
        cache_dir: the cache root (``data.cache_dir``; None: the default root); tokenized datasets
            are kept in :func:`cembed.files.cache_root` ``("tokenized", cache_dir)``, entries keyed
            by ``dataset._fingerprint`` (datasets' content/transform fingerprint) among others.
        num_proc: tokenizer processes (``data.num_proc``): an int, or ``"auto"``/None (every core
            for 50k+ rows, else 1: :func:`cembed.data.tokens.encode.resolve_num_proc`).
        prompts: ``{role: prompt}`` prepended to the role's texts before tokenizing, as
            sentence-transformers' ``Transformer.preprocess`` does (part of the cache key).
        prompt_lengths: ``{role: tokens}`` (:func:`cembed.model.prompts.prompt_lengths`), stored as a
            constant ``<role>_prompt_length`` column: the collator passes it to the model
            (``Pooling(include_prompt=False)``), the sampler compares texts without it.
        sources: per-source prompts instead of ``prompts`` / ``prompt_lengths`` (several sources,
            each with its own prompts): each source's rows get its prompts, and the
            ``<role>_prompt_length`` column holds each row's source's count (null where the source has
            no prompt for the role).
        progress: called as ``progress(rows_done, rows_total)`` about twice a second while
            tokenizing (from another thread); not called when the entry is loaded.

    Returns:
        :class:`Pretokenized`; ``from_cache`` tells whether tokenization was skipped.
    """
    groups = prompt_groups(len(dataset), roles, prompts, prompt_lengths, sources)
    prompted = None
    same = all((g.prompts, g.lengths) == (groups[0].prompts, groups[0].lengths) for g in groups)
    if same and groups[0].prompts:  # the key of one set of prompts, as before sources had their own
        prompted = {"prompts": groups[0].prompts, "prompt_lengths": groups[0].lengths}
    elif not same:
        prompted = {"sources": [[g.rows, g.prompts, g.lengths] for g in groups]}
    key = cache_key(dataset._fingerprint, tokenizer, max_seq_length, roles, prompted)
    root = cache_root("tokenized", cache_dir)
    path = root / key
    loaded = _load_entry(path, dataset)
    if loaded is not None:
        return Pretokenized(loaded, roles, path, True)
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(root / f".{key}.lock") as locked:
        loaded = _load_entry(path, dataset)  # another process finished it while this one waited
        if loaded is not None:
            return Pretokenized(loaded, roles, path, True)
        if locked:  # no live writer holds the lock: these are the folders of killed ones
            for stale in root.glob(f".{key}-*"):
                shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
        try:
            _write_entry(dataset, roles, tokenizer, max_seq_length, groups, num_proc, tmp, progress)
            os.replace(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            if not (path / MANIFEST).exists():
                raise
    loaded = _load_entry(path, dataset)
    if loaded is None:
        raise RuntimeError(f"{path}: the tokenized entry just written cannot be read")
    return Pretokenized(loaded, roles, path, False)


def _write_entry(dataset, roles, tokenizer, max_seq_length, groups, num_proc, tmp: Path, progress) -> None:
    # Tokenizes into ``tmp``: the map's own output files are the entry (no second copy), then the
    # manifest that completes it.
    files = tokenize_into(dataset, roles, tokenizer, max_seq_length, tmp, groups, num_proc, progress)
    features = id_features(dataset, roles, groups)
    texts = dataset._indices is not None
    manifest = {"files": files, "rows": len(dataset), "texts": texts, "features": features.to_dict()}
    (tmp / MANIFEST).write_text(json.dumps(manifest))


def tokenize_stage(
    model,
    data,
    enabled: bool,
    cache_dir: str | None,
    prompts: dict | None = None,
    pad_to_multiple_of: int | None = None,
    source_prompts: list[dict[str, str]] | None = None,
    num_proc: int | str | None = None,
    progress=None,
):
    """Pre-tokenize ``data`` (:class:`cembed.data.rows.TrainingData`) for ``model`` (cached), ``prompts`` (``{role column: prompt}``)
    prepended, or leave tokenizing to the collator. Returns ``(dataset, collator or None, info)``:
    ``collator`` is ``None`` when sentence-transformers' collator (tokenizing on the fly) is used, ``info`` says why.
    ``pad_to_multiple_of`` (``batch.pad_to_multiple_of``) is applied by the pre-tokenized collator.
    ``source_prompts``: one ``{role column: prompt}`` per source of ``data.sources`` instead of ``prompts``.
    ``num_proc`` (``data.num_proc``) and ``progress`` (``progress(rows_done, rows_total)`` while
    tokenizing): as :func:`pretokenize`'s.
    """
    if getattr(data, "manifest", None) is not None:  # a prepared source: its stored ids, checked against the model
        return prepared_stage(model, data, prompts, pad_to_multiple_of)
    roles = data.columns
    if not enabled:
        return data.dataset, None, {"pretokenized": False, "reason": "data.pretokenize is false"}
    collator = collator_for(model, roles, pad_to_multiple_of)
    if collator is None:
        return data.dataset, None, {"pretokenized": False, "reason": "the model's features are not plain token ids"}
    started = time.perf_counter()
    lengths = prompt_lengths(model, prompts or {})  # ``Pooling(include_prompt=False)`` needs them
    # One group per source, so the check below covers each source's rows (and layout).
    sizes = data.source_sizes()
    sources = [SourcePrompts(n, prompts or {}, lengths) for n in sizes]
    if source_prompts is not None:
        sources = [SourcePrompts(n, p, prompt_lengths(model, p)) for n, p in zip(sizes, source_prompts)]
    result = pretokenize(
        data.dataset,
        roles,
        model.tokenizer,
        model.max_seq_length,
        cache_dir,
        num_proc,
        prompts,
        lengths,
        sources,
        progress,
    )
    if not matches_model_preprocessing(model, collator, result.dataset, prompts=prompts, sources=sources):
        return data.dataset, None, {"pretokenized": False, "reason": "stored ids differ from the model's preprocessing"}
    info = {
        "pretokenized": True,
        "from_cache": result.from_cache,
        "cache_path": str(result.cache_path),
        "seconds": round(time.perf_counter() - started, 3),
    }
    return result.dataset, collator, info
