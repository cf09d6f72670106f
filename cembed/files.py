"""Atomic writes (a reader never sees a half-written output file or model folder), the one file lock
(:func:`file_lock`) and the one cache root.

The on-disk caches share one root (:func:`cache_root`), one folder per kind::

    <root>/tokenized/<key>/                    pre-tokenized datasets, each a prepared folder
                                               (cembed.data.tokens.tokenize, cembed.data.tokens.format)
    <root>/embeddings/<model>-<corpus>.npy     corpus embeddings of `cembed eval` and of the
                                               evaluation before training (cembed.eval.embedding_cache)
    <root>/mining/<model fingerprint>/         `cembed mine-negatives`' corpus embeddings (cembed.data.mining)

``<root>`` is ``data.cache_dir`` (or ``--cache-dir``) when given, else ``$CEMBED_CACHE_DIR``, else
``$XDG_CACHE_HOME/cembed`` (``~/.cache/cembed``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Callable, Literal

from cembed.errors import UserError

CacheKind = Literal["tokenized", "embeddings", "mining"]
CACHE_KINDS: tuple[str, ...] = ("tokenized", "embeddings", "mining")


def cache_root(kind: CacheKind, cache_dir: str | Path | None = None) -> Path:
    """The folder that holds one kind of cache (the layout: see the module docstring).

    Args:
        kind: ``"tokenized"`` (pre-tokenized datasets), ``"embeddings"`` (corpus embeddings) or
            ``"mining"`` (``mine-negatives``' embedding cache).
        cache_dir: the cache root the user gave (``data.cache_dir``, ``--cache-dir``); None: the
            default root, ``$CEMBED_CACHE_DIR``, else ``$XDG_CACHE_HOME/cembed`` (``~/.cache/cembed``).

    Returns:
        ``<root>/<kind>``; not created here (the writers create it).

    Raises:
        ValueError: an unknown ``kind``.
    """
    if kind not in CACHE_KINDS:
        raise ValueError(f"cache kind {kind!r}: expected one of {', '.join(CACHE_KINDS)}")
    if cache_dir is not None:
        root = Path(cache_dir).expanduser()
    elif os.environ.get("CEMBED_CACHE_DIR"):
        root = Path(os.environ["CEMBED_CACHE_DIR"]).expanduser()
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cembed"
    return root / kind


def display_path(path: str | Path) -> str:
    """``path`` as a user message shows it: relative to the working directory when it lies inside it
    (``runs/demo`` rather than ``/home/me/project/runs/demo``), else as given. A path outside stays
    absolute rather than climbing out through ``..``: the message then reads the same wherever the
    command runs from."""
    text = str(path)
    try:
        relative = os.path.relpath(text)
    except ValueError:  # another drive (Windows), or no working directory
        return text
    inside = relative != ".." and not relative.startswith(".." + os.sep)
    return relative if inside and len(relative) < len(text) else text


def _umask() -> int:
    """The process umask (read by setting and restoring it: the only portable way)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomic(path: str | Path, write: Callable[[IO], None], binary: bool = False) -> Path:
    """Write a file through ``write(f)`` into a temporary sibling, fsync, then ``os.replace`` it onto
    ``path``: readers see the old file or the whole new one, never a torn one. The file gets the mode a
    plain ``open()`` would give it (0o666 less the umask), not ``mkstemp``'s private 0o600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


@contextmanager
def file_lock(path: str | Path) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on ``path`` (created if absent) while the block runs: one holder at
    a time across the processes of this machine, and of any machine sharing the folder where the file
    system supports it; the kernel drops the lock of a killed process. The writers of prepared folders
    and of tokenize-cache entries (:mod:`cembed.data.tokens.writer`, :mod:`cembed.data.tokens.tokenize`)
    take it.

    Yields:
        True while the lock is held; False where it cannot be taken (no ``fcntl``: not a POSIX system;
        or the file system refuses locks, e.g. ENOLCK on a network file system without a lock
        service): the block then runs unlocked, and must not assume it is alone.
    """
    try:
        import fcntl
    except ImportError:  # not on a POSIX system
        yield False
        return
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def write_new_file(out: Path, text: str) -> Path:
    """Write ``text`` to ``out``, which must not exist (checked atomically by the open); ``cembed init``'s
    writer, here rather than in :mod:`cembed.data.starter` so that ``init --example`` imports no data
    library.

    Raises:
        UserError: the file exists.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with out.open("x", encoding="utf-8") as f:
            f.write(text)
    except FileExistsError:
        raise UserError(f"{out}: already exists; cembed init never overwrites a file") from None
    return out


def write_json_atomic(path: str | Path, obj: Any) -> Path:
    """Write ``obj`` as indented JSON to ``path`` atomically (see :func:`write_atomic`)."""
    return write_atomic(path, lambda f: (json.dump(obj, f, indent=2, default=str), f.write("\n")))


def apply_umask(folder: str | Path) -> None:
    """Give every file and folder under ``folder`` the mode a plain ``open()`` / ``mkdir`` would
    (0o666 / 0o777 less the process umask): libraries write weight shards through private 0o600
    temporary files, which a model or checkpoint folder meant to be shared must not keep."""
    mask = _umask()
    for item in Path(folder).rglob("*"):
        if not item.is_symlink():
            item.chmod((0o777 if item.is_dir() else 0o666) & ~mask)


def save_model_atomic(model, output_dir: str | Path) -> Path:
    """Save a SentenceTransformer into ``output_dir``: written to a temporary sibling folder first,
    then each file is moved into place, so a crash mid-save leaves no torn weight file. Every saved
    file and folder gets the umask's mode (transformers writes its weight shards through a private
    0o600 temporary file, which a shared model folder must not keep)."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".model-tmp-", dir=out))
    try:
        model.save_pretrained(str(tmp))
        apply_umask(tmp)
        for item in tmp.iterdir():
            target = out / item.name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            os.replace(item, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def append_log(path: str | Path, line: str) -> None:
    """Append one timestamped line to a run's log file (``output_dir/train.log``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")


def format_bytes(n: int | float | None) -> str:
    """Bytes -> ``"1.23 GiB"`` / ``"456.0 MiB"``; None -> ``"-"``."""
    if n is None:
        return "-"
    if n >= 1024**3:
        return f"{n / 1024**3:.2f} GiB"
    return f"{n / 1024**2:.1f} MiB"


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_bytes(text: str, flag: str = "--max-memory") -> int:
    """``"8GiB"``, ``"512MiB"``, ``"8GB"``, ``"8G"`` (=GB), ``"123"`` (bytes) -> bytes.

    Raises:
        UserError: not a positive size, naming ``flag``.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS or float(m.group(1)) <= 0:
        raise UserError(f"{flag}: cannot read {text!r} as a memory size; write e.g. 8GiB, 512MiB or 16GB")
    return int(float(m.group(1)) * _UNITS[unit])
