"""Atomic writes: a reader never sees a half-written output file or model folder."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any


def write_json_atomic(path: str | Path, obj: Any) -> Path:
    """Write ``obj`` as indented JSON to ``path`` via a temporary file and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, default=str)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def save_model_atomic(model, output_dir: str | Path) -> Path:
    """Save a SentenceTransformer into ``output_dir``: written to a temporary sibling folder first,
    then each file is moved into place, so a crash mid-save leaves no torn weight file."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".model-tmp-", dir=out))
    try:
        model.save_pretrained(str(tmp))
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
