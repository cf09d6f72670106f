"""Pre-tokenization: tokenize every text column once, cache it on disk, pad in the collator.

Tokenizing 16k pairs per batch in the main process stalls a fast GPU for seconds; padding ids that
were tokenized ahead of time takes milliseconds. :func:`pretokenize` adds a ``<role>_input_ids``
column (int32 lists, special tokens included, truncated to ``max_seq_length``) next to each text
column, with the model's own fast tokenizer, batched and in several processes
(:mod:`cembed.data.tokens.encode`). The result is saved under the cache folder keyed by the data's
fingerprint, the tokenizer and ``max_seq_length``, so a later run with the same inputs loads it
instead of tokenizing again. Each cache entry is a prepared folder (:mod:`cembed.data.tokens.format`),
written by the same code as ``cembed prepare-data``'s (:func:`cembed.data.tokens.writer.move_parts`,
:func:`cembed.data.tokens.format.write_manifest`) and read by the same reader
(:func:`cembed.data.tokens.format.read_folder`); its manifest also names the cache key and the data's
fingerprint.

The batches are then fetched and padded by :mod:`cembed.data.tokens.collator` (:class:`~cembed.data.tokens.collator.TokenIdRows`,
:class:`~cembed.data.tokens.collator.PaddingCollator`), which only pads and stacks the stored ids.

Equivalence with sentence-transformers' own preprocessing (special tokens, lower-casing,
truncation) is checked on real rows before training
(:func:`cembed.data.tokens.model_check.matches_model_preprocessing`); where it does not hold, the
caller falls back to tokenizing in the collator.
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
from cembed.data.tokens.format import (
    MANIFEST,
    SAMPLE_ROWS,
    PreparedManifest,
    PromptedRows,
    read_folder,
    write_manifest,
)
from cembed.data.tokens.model_check import column_layouts, matches_model_preprocessing, prepared_stage
from cembed.data.tokens.writer import move_parts
from cembed.files import cache_root, file_lock
from cembed.model.fingerprint import tokenizer_fingerprint
from cembed.model.prompts import prompt_lengths

# Bump when the stored layout changes, so old caches are not reused (they simply miss once).
# 2: only the new columns, the map's own files, a manifest; 3: <role>_hash; 4: a prepared folder
# (cembed.data.tokens.format: part-*.arrow and cembed_prepared.json, read by its reader).
FORMAT_VERSION = "4"
# What train and validate print when pre-tokenizing falls back (also run_summary's tokenization.warning).
IDS_DIFFER_WARNING = (
    "data.pretokenize: the ids the tokenizer gives differ from the model's own preprocessing on the first rows "
    "(a module that changes the texts or the features), so training tokenizes the texts in the collator, every "
    "step, instead of once (slower; the sampler compares raw texts); set data.pretokenize: false to choose that"
)


def cache_key(
    data_fingerprint: str,
    tokenizer,
    max_seq_length: int,
    roles: list[str],
    prompts: dict | None = None,
    role_lengths: dict[str, int] | None = None,
) -> str:
    """The cache folder name for one (data, tokenizer, max_seq_length, columns, prompts, per-role
    lengths) combination."""
    parts = [FORMAT_VERSION, data_fingerprint, tokenizer_fingerprint(tokenizer), str(max_seq_length), ",".join(roles)]
    if prompts:  # absent for no prompts, so caches made before prompts existed stay valid
        parts.append(json.dumps(prompts, sort_keys=True))
    if role_lengths:  # absent when every role is cut at max_seq_length (a dense model's keys stay as they were)
        parts.append("lengths " + json.dumps(role_lengths, sort_keys=True))
    return xxhash.xxh64_hexdigest("|".join(parts).encode("utf-8"))


@dataclass
class Pretokenized:
    """A dataset with ``<role>`` text and ``<role>_input_ids`` columns, and where it came from."""

    dataset: Any
    roles: list[str]
    cache_path: Path | None
    from_cache: bool


def _load_entry(path: Path, key: str, dataset):
    """The published entry at ``path`` (a prepared folder, read by the format's reader:
    :func:`cembed.data.tokens.format.read_folder`) joined to ``dataset``'s columns, or None: absent,
    or not an entry of this key and layout (damaged, or an older cembed's: then removed, so it is
    rebuilt rather than trusted; a writer publishes a complete folder by renaming it, so a folder at
    ``path`` is never one still being written)."""
    from datasets import concatenate_datasets

    if not path.exists():
        return None
    try:
        manifest, stored = read_folder(path)
        if (manifest.cache_key, manifest.data_fingerprint) != (key, dataset._fingerprint):
            raise ValueError("another entry")
        if len(stored) != len(dataset):
            raise ValueError("row count")
        if manifest.text_columns:  # the entry holds the rows' own columns too
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
    role_lengths: dict[str, int] | None = None,
) -> Pretokenized:
    """Tokenize each role column once (or load the cached result). A null cell (a source that does
    not map the column) stays null.

    The entry is a prepared folder (:mod:`cembed.data.tokens.format`: ``part-*.arrow`` and the typed
    manifest ``cembed_prepared.json``, whose ``cache_key`` and ``data_fingerprint`` name the entry),
    written once: datasets' ``map`` writes the id columns straight into a temporary folder of the
    cache (no copy in datasets' own cache), its files become the parts, the manifest is written
    last, and the folder is renamed into place when complete. It holds only the new columns
    (``<role>_input_ids``, ``<role>_hash``, ``<role>_prompt_length``; ``<role>_hash`` is
    :func:`cembed.data.identity.hash_token_ids` of the ids without the prompt's tokens, uint64, null
    for a null cell, computed inside the map): the texts are joined from ``dataset`` when loaded
    (kept in the entry only when ``dataset`` has an indices mapping, which a column join would
    rewrite; the manifest's ``text_columns`` names them). One process writes an entry at a time (a file lock);
    the next one loads it. A run killed while tokenizing leaves only its temporary folder, removed
    by the next writer. An entry that does not read (damaged, or an older cembed's layout under this
    key) is removed and written again. A dataset with no rows is not cached (``cache_path`` None).

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
        role_lengths: ``{role: tokens}`` where a role is cut elsewhere than at ``max_seq_length`` (a
            multi-vector model's query / document lengths; part of the cache key).

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
    lengths = {r: int(role_lengths.get(r, max_seq_length)) for r in roles} if role_lengths else None
    if lengths is not None and all(n == max_seq_length for n in lengths.values()):
        lengths = None
    key = cache_key(dataset._fingerprint, tokenizer, max_seq_length, roles, prompted, lengths)
    if len(dataset) == 0:
        return Pretokenized(_with_empty_ids(dataset, roles, groups), roles, None, False)
    root = cache_root("tokenized", cache_dir)
    path = root / key
    loaded = _load_entry(path, key, dataset)
    if loaded is not None:
        return Pretokenized(loaded, roles, path, True)
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(root / f".{key}.lock") as locked:
        loaded = _load_entry(path, key, dataset)  # another process finished it while this one waited
        if loaded is not None:
            return Pretokenized(loaded, roles, path, True)
        if locked:  # no live writer holds the lock: these are the folders of killed ones
            for stale in root.glob(f".{key}-*"):
                shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
        try:
            _write_entry(dataset, key, roles, tokenizer, max_seq_length, groups, num_proc, tmp, progress, lengths)
            os.replace(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            if not (path / MANIFEST).exists():
                raise
    loaded = _load_entry(path, key, dataset)
    if loaded is None:
        raise RuntimeError(f"{path}: the tokenized entry just written cannot be read")
    return Pretokenized(loaded, roles, path, False)


def _write_entry(
    dataset, key: str, roles, tokenizer, max_seq_length, groups, num_proc, tmp: Path, progress, lengths=None
) -> None:
    # Writes the entry into ``tmp`` as prepare-data writes a folder: the map's own files become the
    # parts (no second copy), then the typed manifest, last, completes it.
    ids = tmp / "ids"
    ids.mkdir()
    files = tokenize_into(dataset, roles, tokenizer, lengths or max_seq_length, ids, groups, num_proc, progress)
    parts = move_parts(ids, files, tmp)
    shutil.rmtree(ids)
    same = all(g.prompts == groups[0].prompts for g in groups)
    head = dataset.select(range(min(SAMPLE_ROWS, len(dataset)))).to_dict()
    manifest = PreparedManifest(
        columns=list(roles),
        tokenizer=tokenizer_fingerprint(tokenizer),
        max_seq_length=int(max_seq_length),
        rows=len(dataset),
        parts=parts,
        prompts=dict(groups[0].prompts) if same else {},
        samples={r: head[r] for r in roles},
        model=getattr(tokenizer, "name_or_path", "") or "",
        cache_key=key,
        data_fingerprint=dataset._fingerprint,
        text_columns=list(dataset.column_names) if dataset._indices is not None else [],
        source_prompts=[] if same else [PromptedRows(g.rows, dict(g.prompts)) for g in groups],
    )
    write_manifest(tmp, manifest)


def _with_empty_ids(dataset, roles, groups):
    # No rows: nothing to tokenize or cache; the id columns are there, empty.
    from datasets import Dataset, Features

    features = Features({**dataset.features, **id_features(dataset, roles, groups)})
    return Dataset.from_dict({c: [] for c in features}, features=features)


def _collator_tokenizes(data, reason: str, pad_to_multiple_of: int | None, warning: str | None = None):
    """:func:`tokenize_stage`'s answer when sentence-transformers' collator tokenizes (``reason``: why): the
    ``warning`` to print, with a line that ``batch.pad_to_multiple_of`` is not applied where it is set (that
    collator pads each batch to its longest row and has no such setting)."""
    if pad_to_multiple_of is not None:
        ignored = (
            f"batch.pad_to_multiple_of {pad_to_multiple_of} is not applied: sentence-transformers' collator "
            f"tokenizes each batch ({reason}) and pads it to its longest row"
        )
        warning = f"{warning}; {ignored}" if warning else ignored
    info = {"pretokenized": False, "reason": reason}
    return data.dataset, None, info if warning is None else {**info, "warning": warning}


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
    ``collator`` is ``None`` when sentence-transformers' collator (tokenizing on the fly) is used, ``info`` says why
    (``reason``; ``warning``: the line to print when that is a fallback the config did not ask for).
    ``pad_to_multiple_of`` (``batch.pad_to_multiple_of``) is applied by the pre-tokenized collator.
    ``source_prompts``: one ``{role column: prompt}`` per source of ``data.sources`` instead of ``prompts``.
    ``num_proc`` (``data.num_proc``) and ``progress`` (``progress(rows_done, rows_total)`` while
    tokenizing): as :func:`pretokenize`'s.
    """
    if getattr(data, "manifest", None) is not None:  # a prepared source: its stored ids, checked against the model
        # The one source's own prompts where it sets some: what it trains with.
        own = source_prompts[0] if source_prompts else prompts
        return prepared_stage(model, data, own, pad_to_multiple_of)
    roles = data.columns
    if not enabled:
        return data.dataset, None, {"pretokenized": False, "reason": "data.pretokenize is false"}
    layouts = column_layouts(model, roles)
    if layouts is None:
        return _collator_tokenizes(data, "the model tokenizes a column per batch", pad_to_multiple_of)
    collator = collator_for(model, roles, pad_to_multiple_of, layouts.expansions, layouts.strips)
    if collator is None:
        return _collator_tokenizes(data, "the model's features are not plain token ids", pad_to_multiple_of)
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
        layouts.lengths,
    )
    if not matches_model_preprocessing(model, collator, result.dataset, prompts=prompts, sources=sources):
        reason = "stored ids differ from the model's preprocessing"
        return _collator_tokenizes(data, reason, pad_to_multiple_of, IDS_DIFFER_WARNING)
    info = {
        "pretokenized": True,
        "from_cache": result.from_cache,
        "cache_path": str(result.cache_path),
        "seconds": round(time.perf_counter() - started, 3),
    }
    return result.dataset, collator, info
