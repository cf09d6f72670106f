"""Write a prepared folder (:mod:`cembed.data.tokens.format`): the tokenizing map's files become its
parts (:func:`move_parts`, shared with the tokenize cache, :mod:`cembed.data.tokens.tokenize`), and
``cembed prepare-data CONFIG --output DIR``'s folder checks, parts and join.

The config's data stage runs as training runs it (load, column mapping, cell checks:
:func:`cembed.data.load.load_training_data`), the model's tokenizer is loaded as training loads it
(:func:`cembed.model.load.load_model`), the prompts resolved as training resolves them
(:func:`cembed.data.prompts.training_prompts`), and the rows are tokenized by training's own map
(:func:`cembed.data.tokens.encode.tokenize_into`: every core, the ``<role>_hash`` column computed inside
it). The map's output files are the parts: no text is stored, and datasets' own JSON -> Arrow copy
of the input lives in a temporary cache inside ``DIR`` that is removed when the run ends.

Publishing is kill-safe: each run writes into ``DIR/.tmp-K-*``, moves its finished files into
``DIR``, and the manifest (``cembed_prepared.json``) is written last, atomically. A run killed
before that leaves no manifest; its rerun removes what the killed run left and redoes the part.

Several nodes (``part=(K, N)``): node K prepares the contiguous rows
``dataset.shard(N, K, contiguous=True)`` into ``part-K-of-N-XXXXX.arrow`` files (K, N and the
file's index as 5 digits) and a part manifest (``cembed_prepared.part-K-of-N.json``); a folder holding
parts of another N is refused; whichever node finishes last (an ``flock`` on
``DIR/.lock``, then every part manifest present) writes the top manifest, parts in K order, so the
joined folder's rows are in the order a one-process preparation gives.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from cembed.data.identity import TOKEN_SUFFIX
from cembed.data.tokens.format import (
    MANIFEST,
    SAMPLE_ROWS,
    PreparedManifest,
    PreparedPart,
    part_manifest_name,
    write_manifest,
)
from cembed.data.tokens.model_check import matches_model_preprocessing
from cembed.errors import UserError
from cembed.files import display_path, file_lock, write_json_atomic

LOCK = ".lock"
# Names a preparation writes into DIR (anything else makes DIR someone else's folder).
_OWN_PREFIXES = ("part-", ".tmp-", LOCK, "." + MANIFEST, "cembed_prepared.part-", ".cembed_prepared.part-")


@dataclass
class PrepareResult:
    """What :func:`prepare_folder` did (the CLI prints it).

    Byte figures are on disk (``os.stat`` sizes); ``token_bytes`` is the raw size of the token ids
    alone: 4 bytes per token plus 4 bytes per row of offsets, per role column (the acceptance
    figure's denominator).
    """

    folder: Path
    part: int  # K of --part K/N (0 for one process)
    of: int  # N
    rows: int  # rows this run prepared (its part)
    files: list[str]  # the part files this run wrote, in row order
    bytes: int  # their size
    token_bytes: int  # raw ids of this run's rows
    seconds: float
    num_proc: int  # tokenizer processes
    complete: bool  # the top manifest exists (this run wrote it, or the folder was already joined)
    waiting: list[int] = field(default_factory=list)  # parts not finished yet (complete is False)
    total_rows: int = 0  # the whole prepared source (complete only)
    total_files: int = 0
    disk_bytes: int = 0  # every file in the folder (parts and manifests)
    total_token_bytes: int = 0
    fingerprint: str = ""

    @property
    def bytes_per_row(self) -> float:
        """Disk bytes per row of the whole source (complete), else of this run's part."""
        return (self.disk_bytes / self.total_rows) if self.complete else (self.bytes / max(self.rows, 1))

    @property
    def ratio(self) -> float:
        """Disk over raw token-id bytes (the acceptance figure: at most 1.2)."""
        if self.complete:
            return self.disk_bytes / max(self.total_token_bytes, 1)
        return self.bytes / max(self.token_bytes, 1)


def parse_part(text: str | None, env: dict | None = None) -> tuple[int, int]:
    """``--part``'s value as ``(K, N)``: ``None`` -> ``(0, 1)``; ``"K/N"`` with ``0 <= K < N``;
    ``"auto"``: from torchrun's environment, node ``RANK // LOCAL_WORLD_SIZE`` of
    ``WORLD_SIZE // LOCAL_WORLD_SIZE``.

    Raises:
        UserError: anything else, or ``auto`` without torchrun's variables.
    """
    if text is None:
        return 0, 1
    env = os.environ if env is None else env
    if text == "auto":
        try:
            rank, local, world = (int(env[k]) for k in ("RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE"))
        except (KeyError, ValueError):
            raise UserError(
                "--part auto: RANK, LOCAL_WORLD_SIZE and WORLD_SIZE are not set (torchrun sets them); "
                "give --part K/N instead"
            ) from None
        return rank // local, max(world // local, 1)
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise UserError(f"--part {text}: give K/N (node K of N, K = 0..N-1) or auto") from None
    if n < 1 or not 0 <= k < n:
        raise UserError(f"--part {text}: K must be 0..N-1 and N at least 1")
    return k, n


def part_rows(rows: int, k: int, n: int) -> tuple[int, int]:
    """The row range ``[start, end)`` of part K of N over ``rows`` rows: contiguous, in order, sizes
    differing by at most one (the first ``rows % n`` parts one longer), as datasets'
    ``Dataset.shard(n, k, contiguous=True)`` cuts them."""
    div, mod = divmod(rows, n)
    start = div * k + min(k, mod)
    return start, start + div + (1 if k < mod else 0)


def part_file(k: int, n: int, i: int) -> str:
    # N is in the name: runs with another N into the same folder cannot overwrite each other's files.
    return f"part-{i:05d}.arrow" if n == 1 else f"part-{k:05d}-of-{n:05d}-{i:05d}.arrow"


_ONE_PART = re.compile(r"part-\d{5}\.arrow")
_OF_N = re.compile(r"\.?(?:cembed_prepared\.)?part-\d{5}-of-(\d{5})[-.]")


def part_count(name: str) -> int | None:
    """The N of the ``--part K/N`` run that wrote the file ``name`` in a prepared folder (1 for a
    one-process run's part), 0 for a part file of unknown N (an older cembed's ``part-K-I.arrow``),
    None for anything else (temporary folders, the lock)."""
    if _ONE_PART.fullmatch(name):
        return 1
    m = _OF_N.match(name)
    if m:
        return int(m.group(1))
    return 0 if name.startswith("part-") else None


@contextmanager
def temporary_datasets_cache(folder: Path):
    """Point datasets' own cache (its JSON -> Arrow copy of the input, the column mapping's and cell
    checks' files) at ``folder`` while the block runs, and restore it after: the caller removes
    ``folder``, so no second copy of the input stays on disk."""
    import datasets

    names = ("HF_DATASETS_CACHE", "DOWNLOADED_DATASETS_PATH", "EXTRACTED_DATASETS_PATH")
    saved = {n: getattr(datasets.config, n) for n in names}
    folder.mkdir(parents=True, exist_ok=True)
    datasets.config.HF_DATASETS_CACHE = folder
    datasets.config.DOWNLOADED_DATASETS_PATH = folder / datasets.config.DOWNLOADED_DATASETS_DIR
    datasets.config.EXTRACTED_DATASETS_PATH = (
        datasets.config.DOWNLOADED_DATASETS_PATH / datasets.config.EXTRACTED_DATASETS_DIR
    )
    try:
        yield folder
    finally:
        for n, v in saved.items():
            setattr(datasets.config, n, v)


def check_folder(folder: Path, k: int, n: int, overwrite: bool) -> None:
    """Refuse a folder that holds a finished preparation or other files (unless ``overwrite``), and
    remove what a killed run of this part left."""
    where = display_path(folder)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--output {where}: not a folder; give a folder path")
    entries = list(folder.iterdir()) if folder.exists() else []
    foreign = [e.name for e in entries if not e.name.startswith(_OWN_PREFIXES) and e.name != MANIFEST]
    if overwrite and n > 1:
        raise UserError(
            f"--overwrite with --part: remove {where} before the nodes start (a node cannot tell another "
            "node's new part from an old one)"
        )
    if overwrite:
        for e in entries:
            shutil.rmtree(e) if e.is_dir() and not e.is_symlink() else e.unlink()
        return
    if (folder / MANIFEST).exists():
        raise UserError(f"--output {where}: already a prepared source; give another folder or --overwrite")
    if foreign:
        raise UserError(
            f"--output {where}: the folder is not empty ({foreign[0]}...); give an empty or new folder, or --overwrite"
        )
    # Parts of another N would mix with this run's rows (the join takes N manifests of this N only).
    other = next((e.name for e in sorted(entries) if part_count(e.name) not in (None, n)), None)
    if other is not None:
        m = part_count(other)
        theirs = "another number of parts" if m == 0 else "one process (no --part)" if m == 1 else f"--part K/{m}"
        mine = "one process (no --part)" if n == 1 else f"--part {k}/{n}"
        raise UserError(
            f"--output {where}: holds {other}, written by {theirs}; this run is {mine}: give a new folder, "
            f"or remove {where} and prepare every part again"
        )
    # An unfinished preparation (no manifest): this part's leftovers go, the other parts' stay.
    mine = (
        (".tmp-", "part-", "." + MANIFEST, "cembed_prepared.part-", ".cembed_prepared.part-")
        if n == 1
        else (f".tmp-{k:05d}-", f"part-{k:05d}-of-{n:05d}-")
    )
    manifest = part_manifest_name(k, n)
    for e in entries:
        if e.name.startswith(mine) or e.name == manifest or e.name.startswith("." + manifest):
            shutil.rmtree(e, ignore_errors=True) if e.is_dir() else e.unlink(missing_ok=True)


def token_bytes(paths: list[Path], roles: list[str]) -> int:
    """Raw bytes of the token ids in the Arrow stream files ``paths``: 4 per token plus 4 per row of
    offsets, per role column (read record batch by record batch, memory-mapped)."""
    total = 0
    for path in paths:
        with pa.memory_map(str(path)) as source:
            for batch in pa.ipc.open_stream(source):
                for role in roles:
                    col = batch.column(role + TOKEN_SUFFIX)
                    if len(col):
                        offsets = col.offsets
                        total += 4 * (offsets[len(col)].as_py() - offsets[0].as_py()) + 4 * len(col)
    return total


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def move_parts(ids_dir: Path, files: list[str], folder: Path, k: int = 0, n: int = 1) -> list[PreparedPart]:
    """Move the tokenizing map's files (:func:`cembed.data.tokens.encode.tokenize_into`; ``files``
    in ``ids_dir``, in row order) into ``folder`` as the parts of part K of N (``part-00000.arrow`` ...
    for one part), and return them as the manifest lists them. The tokenize cache and
    ``prepare-data`` both publish their ids through it; the manifest is written after it, last
    (:func:`cembed.data.tokens.format.write_manifest`)."""
    names = [part_file(k, n, i) for i in range(len(files))]
    for name, new in zip(files, names):
        os.replace(ids_dir / name, folder / new)
    return [PreparedPart(f, _stream_rows(folder / f), (folder / f).stat().st_size) for f in names]


def publish_part(
    folder: Path, k: int, n: int, ids_dir: Path, files: list[str], manifest: PreparedManifest, procs: int
) -> PrepareResult:
    """Move the map's files from ``ids_dir`` into ``folder`` as part K's files (``manifest.parts``
    filled in: :func:`move_parts`) and, with several parts, write part K's manifest, last."""
    manifest.parts = move_parts(ids_dir, files, folder, k, n)
    names = [p.file for p in manifest.parts]
    paths = [folder / f for f in names]
    ids = token_bytes(paths, manifest.columns)
    if n > 1:
        envelope = {"part": k, "of": n, "token_bytes": ids, "manifest": manifest.to_json()}
        write_json_atomic(folder / part_manifest_name(k, n), envelope)
    size = sum(p.bytes for p in manifest.parts)
    return PrepareResult(folder, k, n, manifest.rows, names, size, ids, 0.0, procs, False)


def _stream_rows(path: Path) -> int:
    with pa.memory_map(str(path)) as source:
        return sum(b.num_rows for b in pa.ipc.open_stream(source))


def check_equivalence(model, collator, rows, ids_dir: Path, files: list[str], prompts: dict, name: str) -> None:
    """Refuse ids that differ from the model's own preprocessing on the first rows (training would
    fall back to tokenizing the texts, which a prepared source does not have). ``files``: the map's
    files in ``ids_dir``, in row order."""
    from datasets import Dataset, concatenate_datasets

    m = min(SAMPLE_ROWS, len(rows))
    if m == 0:  # a part with no rows (fewer rows than parts)
        return
    ids = concatenate_datasets([Dataset.from_file(str(ids_dir / f)) for f in files])
    head = concatenate_datasets([rows.select(range(m)), ids.select(range(m))], axis=1)
    if not matches_model_preprocessing(model, collator, head, prompts=prompts):
        raise UserError(
            f"model {name}: the stored ids differ from the model's own preprocessing; a prepared source "
            "needs a model whose inputs are plain token ids: train from the text source instead"
        )


def manifest_value(value) -> str:
    """A part manifest's field as a message shows it: prompts ``anchor 'query: '`` (``none``), a list
    comma-separated, anything else as it is."""
    if isinstance(value, dict):
        return ", ".join(f"{role} {prompt!r}" for role, prompt in value.items()) or "none"
    if isinstance(value, list):
        return ", ".join(map(str, value))
    return str(value)


def join_parts(folder: Path, n: int, result: PrepareResult) -> None:
    """Under ``DIR/.lock``: when every part's manifest is there, write the top manifest (parts in K
    order); else record the parts still missing in ``result.waiting``."""
    # Where locks are refused the join still runs (the manifest is written atomically either way).
    with file_lock(folder / LOCK):
        missing = [k for k in range(n) if not (folder / part_manifest_name(k, n)).exists()]
        if missing:
            result.waiting = missing
            return
        envelopes = [json.loads((folder / part_manifest_name(k, n)).read_text()) for k in range(n)]
        first = envelopes[0]["manifest"]
        for k, env in enumerate(envelopes):
            m = env["manifest"]
            for key in ("columns", "tokenizer", "max_seq_length", "role_lengths", "prompts", "rows_read", "source"):
                if m.get(key) != first.get(key):
                    raise UserError(
                        f"{display_path(folder)}: {key} differs between the parts: {manifest_value(m[key])} in "
                        f"part {k} of {n} ({part_manifest_name(k, n)}), {manifest_value(first[key])} in part 0; "
                        f"every node must prepare with the same config and model: remove {display_path(folder)} "
                        "and prepare again"
                    )
        result.complete = True
        result.total_token_bytes = sum(env["token_bytes"] for env in envelopes)
        if (folder / MANIFEST).exists():  # joined by another node that saw every part too
            return
        parts = [PreparedPart(**p) for env in envelopes for p in env["manifest"]["parts"]]
        top = PreparedManifest(**{**first, "parts": parts, "rows": sum(p.rows for p in parts)})
        write_manifest(folder, top)
