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
truncation) is checked on real rows before training (:func:`matches_model_preprocessing`); where it
does not hold, the caller falls back to tokenizing in the collator.
"""

from __future__ import annotations

import bisect
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import xxhash

from cembed.data.identity import HASH_SUFFIX, PROMPT_SUFFIX, TOKEN_SUFFIX, hash_token_ids
from cembed.data.tokens.collator import PaddingCollator, TokenIdRows, collator_for
from cembed.files import cache_root
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


def _tokenize_batch(
    batch: dict[str, list],
    indices: list[int],
    roles: list[str],
    tokenizer,
    max_length: int,
    starts: list[int],
    prompts: list[dict[str, str]],
    lengths: list[dict[str, int]] | None = None,
) -> pa.Table:
    # Module level: datasets.map(num_proc>1) pickles it into worker processes. Row ``i`` belongs to
    # the source whose first row is the last of ``starts`` <= i, and takes that source's prompts; a
    # null cell (a source without the column) stays null. Returns an arrow table (the ids converted
    # once, here, and handed to the map's writer as they are): ``<role>_input_ids``, ``<role>_hash``
    # per role, then ``<role>_prompt_length`` for the roles some source prompts.
    groups = [bisect.bisect_right(starts, i) - 1 for i in indices]
    out = {}
    for role in roles:
        cells = batch[role]
        present = [k for k, t in enumerate(cells) if t is not None]
        texts = [prompts[groups[k]].get(role, "") + cells[k] for k in present]
        enc = tokenizer(
            texts,
            truncation=True,
            max_length=max_length,
            add_special_tokens=True,
            return_attention_mask=False,
            return_token_type_ids=False,
        )["input_ids"]
        ids: list = [None] * len(cells)
        for k, row_ids in zip(present, enc):
            ids[k] = row_ids
        column = pa.array(ids, type=pa.list_(pa.int32()))
        out[role + TOKEN_SUFFIX] = column
        skip = [(lengths[g].get(role) or 0) if lengths else 0 for g in groups]
        out[role + HASH_SUFFIX] = _row_hashes(column, skip)
    # Each row's source's prompt length (null where it has none), for the roles some source prompts.
    for role in [r for r in roles if any(r in g for g in lengths or [])]:
        out[role + PROMPT_SUFFIX] = pa.array([lengths[g].get(role) for g in groups], type=pa.int32())
    return pa.table(out)


def _row_hashes(ids: pa.Array, skip: list[int]) -> pa.Array:
    # The sampler's hash of each row's ids after its prompt's ``skip`` tokens
    # (:func:`cembed.data.identity.hash_token_ids`, what ``row_hashes`` computes from the stored
    # columns), null for a null cell: computed inside the parallel map, so no process has to hash
    # the whole column later. One vectorised pass over the batch's arrow ids.
    hashes = hash_token_ids(ids, np.asarray(skip, dtype=np.int64))
    return pa.array(hashes, type=pa.uint64(), mask=ids.is_null().to_numpy(zero_copy_only=False))


@dataclass(frozen=True)
class SourcePrompts:
    """One training source's prompts for :func:`pretokenize`: its ``rows`` follow the previous
    sources' rows in the dataset (``data.train.<name>.prompts``, see :mod:`cembed.model.prompts`)."""

    rows: int
    prompts: dict[str, str] = field(default_factory=dict)  # role column -> prompt (absent or "": none)
    lengths: dict[str, int] = field(default_factory=dict)  # role column -> the prompt's token count


def _prompt_groups(
    n: int, roles: list[str], prompts, prompt_lengths, sources: list[SourcePrompts] | None
) -> list[SourcePrompts]:
    """The per-source prompts, restricted to ``roles`` and non-empty prompts (one group for the
    whole dataset when ``sources`` is None)."""
    groups = sources if sources is not None else [SourcePrompts(n, prompts or {}, prompt_lengths or {})]
    out = []
    for g in groups:
        kept = {r: p for r, p in g.prompts.items() if p and r in roles}
        out.append(SourcePrompts(g.rows, kept, {r: n for r, n in g.lengths.items() if r in kept}))
    if sum(g.rows for g in out) != n:
        raise ValueError(f"the sources' prompts cover {sum(g.rows for g in out)} rows, the dataset {n}")
    return out


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
# Rows below which tokenizing stays in this process: starting worker processes (each unpickles the
# tokenizer) costs more than it saves.
PARALLEL_MIN_ROWS = 50_000


def resolve_num_proc(num_proc: int | str | None, rows: int) -> int:
    """The tokenizer processes for ``rows`` rows: an int as given; ``"auto"`` (or None): every core
    this process may run on (``os.sched_getaffinity``) for :data:`PARALLEL_MIN_ROWS` rows or more, else 1."""
    if isinstance(num_proc, int):
        return max(1, num_proc)
    if rows < PARALLEL_MIN_ROWS:
        return 1
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


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


@contextmanager
def _writer_lock(lock_path: Path):
    """Hold an exclusive ``flock`` on ``lock_path`` (one writer per entry at a time, across the
    processes of this machine and of any machine sharing the folder where the file system supports
    it). The kernel drops the lock of a killed process. Yields whether the lock is held (False where
    the file system refuses locks: then no stale folder can be told from a live writer's)."""
    try:
        import fcntl
    except ImportError:  # not on a POSIX system
        yield False
        return
    with open(lock_path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:  # e.g. ENOLCK on a network file system without a lock service
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _watch_progress(folder: Path, total: int, progress, stop: threading.Event) -> None:
    # Sums the row counts the tokenizing processes write into ``folder`` (one file each) and hands
    # the total to ``progress`` twice a second, until ``stop``.
    while not stop.wait(0.5):
        done = 0
        for f in folder.glob("[0-9]*"):  # not the ".<pid>" files being written
            try:
                done += int(f.read_text() or 0)
            except (OSError, ValueError):  # being rewritten right now: counted next time
                pass
        progress(min(done, total), total)


def _tokenize_batch_counted(batch, indices, progress_dir: str | None = None, keep: list[str] = (), **kwargs):
    # The map function: tokenizes, then records how many rows this process has done (for the
    # progress bar), in a file of its own. The map writes a returned table as it is (no merge with
    # the input): the ``keep`` input columns are added to it.
    out = _tokenize_batch(batch, indices, **kwargs)
    for name in keep:
        out = out.append_column(name, pa.array(batch[name]))
    if progress_dir is not None:
        global _rows_done
        _rows_done += len(indices)
        tmp = os.path.join(progress_dir, f".{os.getpid()}")
        with open(tmp, "w") as f:
            f.write(str(_rows_done))
        os.replace(tmp, os.path.join(progress_dir, str(os.getpid())))
    return out


_rows_done = 0


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
            for 50k+ rows, else 1: :func:`resolve_num_proc`).
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
    groups = _prompt_groups(len(dataset), roles, prompts, prompt_lengths, sources)
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
    with _writer_lock(root / f".{key}.lock") as locked:
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


@contextmanager
def main_process_interrupts():
    """While the block runs, a SIGINT (Ctrl-C) interrupts this process only: the tokenizer processes
    ``datasets.map(num_proc=...)`` forks inherit a handler that ignores it (the terminal sends it to
    every process of the group; each would print its own ``KeyboardInterrupt`` traceback), while
    this process raises ``KeyboardInterrupt`` as by default and its pool ends them. Outside the main
    thread (no signal handler can be set there) it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    main = os.getpid()

    def handle(signum, frame):
        if os.getpid() == main:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupted(err: BaseException) -> bool:
    """Whether ``err`` was raised while a ``KeyboardInterrupt`` was being handled (its context chain)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, KeyboardInterrupt):
            return True
        seen.add(id(err))
        err = err.__context__
    return False


def _write_entry(dataset, roles, tokenizer, max_seq_length, groups, num_proc, tmp: Path, progress) -> None:
    # Tokenizes into ``tmp``: the map's own output files are the entry (no second copy), then the
    # manifest that completes it.
    from datasets import Features, List, Value

    texts = dataset._indices is not None  # a column join would rewrite the whole table (flatten_indices)
    features = dataset.features.copy() if texts else Features()
    for role in roles:
        features[role + TOKEN_SUFFIX] = List(Value("int32"))
        features[role + HASH_SUFFIX] = Value("uint64")
    for role in [r for r in roles if any(r in g.lengths for g in groups)]:
        features[role + PROMPT_SUFFIX] = Value("int32")
    procs = resolve_num_proc(num_proc, len(dataset))
    progress_dir = None
    if progress is not None:
        progress_dir = tmp / "progress"
        progress_dir.mkdir()
    stop = threading.Event()
    watcher = None
    if progress is not None:
        watcher = threading.Thread(
            target=_watch_progress, args=(progress_dir, len(dataset), progress, stop), daemon=True
        )
        watcher.start()
    global _rows_done
    _rows_done = 0
    try:
        with main_process_interrupts():
            tokenized = dataset.map(
                _tokenize_batch_counted,
                batched=True,
                with_indices=True,
                batch_size=2048,
                num_proc=procs if procs > 1 else None,
                fn_kwargs={
                    "roles": roles,
                    "tokenizer": tokenizer,
                    "max_length": max_seq_length,
                    "starts": [sum(g.rows for g in groups[:i]) for i in range(len(groups))],
                    "prompts": [g.prompts for g in groups],
                    "lengths": [g.lengths for g in groups],
                    "progress_dir": None if progress_dir is None else str(progress_dir),
                    "keep": list(dataset.column_names) if texts else [],
                },
                features=features,
                remove_columns=None if texts else dataset.column_names,
                cache_file_name=str(tmp / "ids.arrow"),
                load_from_cache_file=False,
                desc="Tokenizing",
            )
    except Exception as err:
        if _interrupted(err):  # datasets' pool turns a Ctrl-C into a TimeoutError while it waits
            raise KeyboardInterrupt from None
        raise
    finally:
        stop.set()
        if watcher is not None:
            watcher.join()
    if progress_dir is not None:
        progress(len(dataset), len(dataset))
        shutil.rmtree(progress_dir, ignore_errors=True)
    files = [Path(f["filename"]).name for f in tokenized.cache_files]  # none for no rows
    manifest = {"files": files, "rows": len(tokenized), "texts": texts, "features": tokenized.features.to_dict()}
    (tmp / MANIFEST).write_text(json.dumps(manifest))


def tokenize_into(
    dataset,
    roles: list[str],
    tokenizer,
    max_seq_length: int,
    folder: Path,
    prompts: dict[str, str] | None = None,
    prompt_lengths: dict[str, int] | None = None,
    num_proc: int | str | None = None,
    progress=None,
) -> list[str]:
    """Tokenize ``dataset`` (no indices mapping) with training's map into the existing ``folder``,
    not cached, texts not kept: Arrow stream files with ``<role>_input_ids``, ``<role>_hash`` and
    ``<role>_prompt_length`` (prompted roles), as :func:`pretokenize` stores them. Arguments as
    :func:`pretokenize`'s. Returns the files' names inside ``folder``, in row order (none for no rows).

    Raises:
        ValueError: ``dataset`` has an indices mapping (flatten it first).
    """
    if dataset._indices is not None:
        raise ValueError("tokenize_into: flatten the dataset's indices first (the map would keep its texts)")
    if len(dataset) == 0:  # no rows: no file (datasets' map would hand back the input's own files)
        return []
    groups = _prompt_groups(len(dataset), roles, prompts, prompt_lengths, None)
    _write_entry(dataset, roles, tokenizer, max_seq_length, groups, num_proc, Path(folder), progress)
    return json.loads((Path(folder) / MANIFEST).read_text())["files"]


def matches_model_preprocessing(
    model,
    collator: PaddingCollator,
    dataset,
    rows: int = 64,
    prompts: dict[str, str] | None = None,
    sources: list[SourcePrompts] | None = None,
) -> bool:
    """Whether padding the stored ids of the first ``rows`` rows (of each source, with ``sources``)
    gives exactly what ``model.preprocess`` gives for their texts with the role's prompt (ids,
    attention mask, token types, prompt length), for the columns the source maps, and no batch
    carries a column its source does not map. The ids are fetched as training fetches them
    (:class:`TokenIdRows`) and padded to the longest row, as the model pads (``pad_to_multiple_of``
    is left out)."""
    plain = replace(collator, pad_to_multiple_of=None)
    start = 0
    for group in _prompt_groups(len(dataset), collator.roles, prompts, None, sources):
        indices = list(range(start, start + min(rows, group.rows)))
        start += group.rows
        sample = dataset.select(indices)
        batch = plain(TokenIdRows(dataset, collator.roles).__getitems__(indices))
        for role in collator.roles:
            if sample[0][role] is None:  # a column this source does not map is left out of its batches
                if any(k.startswith(role + "_") for k in batch):
                    return False
                continue
            prompt = group.prompts.get(role) or None
            ref = model.preprocess(sample[role], prompt=prompt) if prompt else model.preprocess(sample[role])
            for key in ("input_ids", "attention_mask", "token_type_ids"):
                if key in ref and not torch.equal(ref[key].to(torch.int64), batch[f"{role}_{key}"]):
                    return False
            if ref.get("prompt_length") != batch.get(role + PROMPT_SUFFIX):
                return False
    return True


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
        from cembed.data.tokens.model_check import prepared_stage

        return prepared_stage(model, data, prompts, pad_to_multiple_of, matches_model_preprocessing)
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
