"""The tokenizing map: texts -> the id columns of the one on-disk format (:mod:`cembed.data.tokens.format`).

:func:`tokenize_into` runs datasets' ``map`` with the model's own fast tokenizer, batched and in
several processes, and writes its output straight into a folder as Arrow stream files: per role
column ``<role>_input_ids`` (int32 lists, special tokens included, truncated to ``max_seq_length``,
the role's prompt prepended), ``<role>_hash`` (:func:`cembed.data.identity.hash_token_ids` of the
ids without the prompt's tokens, uint64, computed inside the map) and ``<role>_prompt_length`` for
prompted roles. Those files become the parts of a prepared folder, whether the tokenize cache
(:func:`cembed.data.tokens.tokenize.pretokenize`) or ``cembed prepare-data``
(:mod:`cembed.data.prepare_folder`) publishes it (:mod:`cembed.data.tokens.writer`).
"""

from __future__ import annotations

import bisect
import os
import shutil
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from cembed.data.identity import HASH_SUFFIX, PROMPT_SUFFIX, TOKEN_SUFFIX, hash_token_ids


@dataclass(frozen=True)
class SourcePrompts:
    """One training source's prompts for :func:`tokenize_into`: its ``rows`` follow the previous
    sources' rows in the dataset (``data.train.<name>.prompts``, see :mod:`cembed.model.prompts`)."""

    rows: int
    prompts: dict[str, str] = field(default_factory=dict)  # role column -> prompt (absent or "": none)
    lengths: dict[str, int] = field(default_factory=dict)  # role column -> the prompt's token count


def prompt_groups(
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


def _tokenize_batch(
    batch: dict[str, list],
    indices: list[int],
    roles: list[str],
    tokenizer,
    max_length: int | dict[str, int],
    starts: list[int],
    prompts: list[dict[str, str]],
    lengths: list[dict[str, int]] | None = None,
) -> pa.Table:
    # Module level: datasets.map(num_proc>1) pickles it into worker processes. Row ``i`` belongs to
    # the source whose first row is the last of ``starts`` <= i, and takes that source's prompts; a
    # null cell (a source without the column) stays null. Returns an arrow table (the ids converted
    # once, here, and handed to the map's writer as they are): ``<role>_input_ids``, ``<role>_hash``
    # per role, then ``<role>_prompt_length`` for the roles some source prompts. ``max_length``: one for
    # every role, or per role (a multi-vector model's query and document lengths).
    groups = [bisect.bisect_right(starts, i) - 1 for i in indices]
    out = {}
    for role in roles:
        cells = batch[role]
        present = [k for k, t in enumerate(cells) if t is not None]
        texts = [prompts[groups[k]].get(role, "") + cells[k] for k in present]
        enc = tokenizer(
            texts,
            truncation=True,
            max_length=max_length[role] if isinstance(max_length, dict) else max_length,
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


def text_hashes(tokenizer, texts: list[str], max_length: int) -> np.ndarray:
    """Each text's identity as training compares it: the hash :func:`_tokenize_batch` stores as
    ``<role>_hash`` for a text without a prompt (its ids after truncation to ``max_length``, special
    tokens included: :func:`cembed.data.identity.hash_token_ids`), so "The cat." and "the  cat."
    hash equal under an uncased tokenizer. Shape ``(len(texts),)`` uint64; tokenized
    ``_HASH_SLICE`` texts at a time (bounds the id lists held at once)."""
    out = np.empty(len(texts), dtype=np.uint64)
    for start in range(0, len(texts), _HASH_SLICE):
        part = texts[start : start + _HASH_SLICE]
        table = _tokenize_batch({"text": part}, list(range(len(part))), ["text"], tokenizer, max_length, [0], [{}])
        out[start : start + len(part)] = table.column("text" + HASH_SUFFIX).to_numpy()
    return out


_HASH_SLICE = 65_536


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


def id_features(dataset, roles: list[str], groups: list[SourcePrompts]):
    """The ``datasets.Features`` :func:`tokenize_into` writes for ``dataset``: ``<role>_input_ids``
    and ``<role>_hash`` per role, then ``<role>_prompt_length`` for the roles some group prompts;
    after ``dataset``'s own columns where it has an indices mapping (they are kept, see
    :func:`tokenize_into`)."""
    from datasets import Features, List, Value

    features = dataset.features.copy() if dataset._indices is not None else Features()
    for role in roles:
        features[role + TOKEN_SUFFIX] = List(Value("int32"))
        features[role + HASH_SUFFIX] = Value("uint64")
    for role in [r for r in roles if any(r in g.lengths for g in groups)]:
        features[role + PROMPT_SUFFIX] = Value("int32")
    return features


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


def tokenize_into(
    dataset,
    roles: list[str],
    tokenizer,
    max_seq_length: int | dict[str, int],
    folder: Path,
    sources: list[SourcePrompts],
    num_proc: int | str | None = None,
    progress=None,
) -> list[str]:
    """Tokenize ``dataset`` with datasets' ``map`` straight into the existing ``folder`` (no copy in
    datasets' own cache): Arrow stream files with the columns :func:`id_features` names. A null cell
    (a source that does not map the column) stays null. Where ``dataset`` has an indices mapping (a
    selection), its own columns are kept in the files beside the ids, since joining the ids to it
    would rewrite the whole table (``flatten_indices``): flatten it first for ids only.

    Args:
        dataset: a ``datasets.Dataset`` with one text column per role.
        roles: the text columns, in loss order.
        tokenizer: the model's (fast) tokenizer.
        max_seq_length: truncation length in tokens, special tokens included; or one per role
            (:meth:`cembed.model.kinds.registry.ModelKind.token_layout`).
        folder: where the files go (it exists; a ``progress`` folder is made and removed inside).
        sources: each source's prompts, in row order (:func:`prompt_groups`); each row's source's
            prompt is prepended before tokenizing, as sentence-transformers'
            ``Transformer.preprocess`` does, and its token count stored in ``<role>_prompt_length``
            (null where the source has no prompt for the role).
        num_proc: tokenizer processes (``data.num_proc``): an int, or ``"auto"``/None
            (:func:`resolve_num_proc`).
        progress: called as ``progress(rows_done, rows_total)`` about twice a second while
            tokenizing (from another thread).

    Returns:
        The files' names inside ``folder``, in row order (none for no rows).
    """
    if len(dataset) == 0:  # no rows: no file (datasets' map would hand back the input's own files)
        return []
    folder = Path(folder)
    groups = sources
    texts = dataset._indices is not None
    procs = resolve_num_proc(num_proc, len(dataset))
    progress_dir = None
    if progress is not None:
        progress_dir = folder / "progress"
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
                features=id_features(dataset, roles, groups),
                remove_columns=None if texts else dataset.column_names,
                cache_file_name=str(folder / "ids.arrow"),
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
    return [Path(f["filename"]).name for f in tokenized.cache_files]
