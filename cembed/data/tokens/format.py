"""The one on-disk token-id format, a *prepared folder*: training data already tokenized, stored once
as memory-mappable Arrow files plus a typed manifest, and its one reader (:func:`read_folder`).

Two writers produce it, both through :mod:`cembed.data.tokens.writer` with the same tokenizing map
(:func:`cembed.data.tokens.encode.tokenize_into`): ``cembed prepare-data`` (a *prepared source*), and
the tokenize cache, whose every entry (``<cache root>/tokenized/<key>/``,
:func:`cembed.data.tokens.tokenize.pretokenize`) is such a folder, its manifest naming the cache key.

Where a corpus outgrows one preparation per run (tens to hundreds of millions of rows), it is
prepared once -- by ``cembed prepare-data``, or by any engine that writes Arrow (a ``datasets`` map
per node, Ray Data, Spark + pyarrow) -- and every run, on every node, memory-maps the result
(``data.train: {kind: prepared, path: DIR}``). No text is stored: disk is one copy of the token ids
(plus 8 bytes per row and column of row hashes).

Layout of ``DIR``::

    cembed_prepared.json        the manifest (:class:`PreparedManifest`); its presence completes DIR
    part-00000.arrow ...        Arrow IPC *stream* files (what ``datasets.Dataset.from_file`` and
                                ``pyarrow.ipc.new_stream`` read and write), in row order; any names the
                                manifest lists (``cembed prepare-data --part K/N`` writes
                                ``part-K-of-N-I.arrow`` and ``cembed_prepared.part-K-of-N.json``)

Columns of every part, for each role column ``<role>`` of ``columns`` (loss order: ``anchor``,
``positive``, ``negative_1`` ...):

- ``<role>_input_ids``: ``list<int32>``, the tokenizer's ids with special tokens, truncated to
  ``max_seq_length``, the role's prompt included (required);
- ``<role>_prompt_length``: ``int32``, the prompt's token count (only where the role has a prompt);
- ``<role>_hash``: ``uint64``, :func:`cembed.data.identity.hash_token_ids` of the ids without the prompt
  (optional: computed at load time where absent, so an external engine need not reproduce it).

The fingerprint (:func:`parts_fingerprint`) hashes each part's name, row count and byte size in
order, with the tokenizer fingerprint, ``max_seq_length``, columns and prompts: every rank computes
it from what it reads, and ranks that read different data are refused.

Versions: 2 added the tokenize cache's fields (``cache_key``, ``data_fingerprint``, ``text_columns``,
``source_prompts``; all optional, a prepared source leaves them empty). A version-1 manifest (the
same fields less those) still reads.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from cembed.data.identity import TOKEN_SUFFIX
from cembed.errors import UserError, first_line
from cembed.files import display_path, write_json_atomic

MANIFEST = "cembed_prepared.json"
FORMAT = "cembed-prepared"
VERSION = 2
READS = (1, 2)  # the versions this cembed reads: 2 only added optional fields
# The rows of each source kept as text in the manifest: the equivalence check against the model's
# own preprocessing, ``validate``'s first row and the model card's examples read them.
SAMPLE_ROWS = 64


@dataclass
class PreparedPart:
    """One Arrow stream file of a prepared source."""

    file: str  # name inside the prepared folder
    rows: int
    bytes: int


@dataclass
class PromptedRows:
    """One source's rows and their prompts, in row order (a tokenize-cache entry of several sources
    whose prompts differ)."""

    rows: int
    prompts: dict[str, str] = field(default_factory=dict)  # role -> prompt


@dataclass
class PreparedManifest:
    """What ``cembed_prepared.json`` holds (written last: a folder without it is incomplete)."""

    columns: list[str]  # role columns, loss order
    tokenizer: str  # cembed.model.fingerprint.tokenizer_fingerprint of the tokenizer that made the ids
    max_seq_length: int
    rows: int
    parts: list[PreparedPart]
    prompts: dict[str, str] = field(default_factory=dict)  # role -> prompt prepended before tokenizing
    samples: dict[str, list[str | None]] = field(default_factory=dict)  # role -> the first rows' texts
    model: str = ""  # the model it was prepared for (for messages)
    source: str = ""  # what it was prepared from (for messages)
    rows_read: int | None = None
    rows_dropped: int = 0
    input_files: int | None = None
    fingerprint: str = ""
    # The tokenize cache's facts (version 2; empty in a prepared source):
    cache_key: str = ""  # the entry's key (its folder name: cembed.data.tokens.tokenize.cache_key)
    data_fingerprint: str = ""  # datasets' fingerprint of the rows it tokenized
    text_columns: list[str] = field(default_factory=list)  # the rows' own columns the parts also hold
    source_prompts: list[PromptedRows] = field(default_factory=list)  # per source, where they differ (prompts: {})
    # role -> tokens it is cut at, for the roles cut elsewhere than at max_seq_length (a multi-vector model's
    # query / document lengths, cembed.model.kinds.registry.ModelKind.token_layout); empty: every role at it.
    role_lengths: dict[str, int] = field(default_factory=dict)
    format: str = FORMAT
    version: int = VERSION

    def to_json(self) -> dict[str, Any]:
        """The manifest as a JSON-serializable dict."""
        return asdict(self)


def parts_fingerprint(manifest: PreparedManifest) -> str:
    """xxh64 (16 hex characters) of the parts (name, rows, bytes, in order), the tokenizer fingerprint,
    ``max_seq_length``, the columns and the prompts: what decides the training rows. Cheap (no file
    content is read), so every rank recomputes it from what it finds on disk. Per-source prompts
    (``source_prompts``) count where there are some, so a folder without them keeps its version-1
    fingerprint."""
    key = {
        "parts": [[p.file, p.rows, p.bytes] for p in manifest.parts],
        "tokenizer": manifest.tokenizer,
        "max_seq_length": manifest.max_seq_length,
        "columns": manifest.columns,
        "prompts": manifest.prompts,
    }
    if manifest.source_prompts:
        key["source_prompts"] = [[g.rows, g.prompts] for g in manifest.source_prompts]
    if manifest.role_lengths:  # only where some role is cut elsewhere, so other folders keep their fingerprint
        key["role_lengths"] = manifest.role_lengths
    return xxhash.xxh64_hexdigest(json.dumps(key, sort_keys=True).encode("utf-8"))


def write_manifest(folder: str | Path, manifest: PreparedManifest) -> Path:
    """Set ``manifest.fingerprint`` and write the manifest into ``folder`` atomically (the last step of
    a preparation: it publishes the folder). Returns the manifest's path."""
    manifest.fingerprint = parts_fingerprint(manifest)
    return write_json_atomic(Path(folder) / MANIFEST, manifest.to_json())


def part_manifest_name(k: int, n: int) -> str:
    """The file holding part K of N's manifest in a prepared folder (``cembed prepare-data --part K/N``)."""
    return f"cembed_prepared.part-{k:05d}-of-{n:05d}.json"


_PART_MANIFEST = re.compile(r"cembed_prepared\.part-(\d{5})-of-(\d{5})\.json")


def _parts_message(folder: Path, where: str) -> str | None:
    """What an unjoined ``--part`` preparation in ``folder`` lacks, as one line: the parts done and
    missing and the command to run; None where no part manifest is there."""
    found = [m for m in map(_PART_MANIFEST.fullmatch, sorted(p.name for p in folder.iterdir())) if m]
    if not found:
        return None
    n = int(found[0].group(2))
    done = sorted({int(m.group(1)) for m in found if int(m.group(2)) == n})
    missing = [k for k in range(n) if k not in done]
    if not missing:
        return (
            f"{where}: all {n} parts are prepared but not joined (no {MANIFEST}): run the last part's "
            "cembed prepare-data command again"
        )

    def ks(ks: list[int]) -> str:
        return f"part {ks[0]}" if len(ks) == 1 else "parts " + ", ".join(map(str, ks))

    verb = "is" if len(done) == 1 else "are"
    runs = ", ".join(f"--part {k}/{n}" for k in missing)
    return (
        f"{where}: not complete: {ks(done)} of {n} {verb} prepared, {ks(missing)} "
        f"{'is' if len(missing) == 1 else 'are'} missing: run cembed prepare-data CONFIG --output {where} {runs} "
        f"(the last part to finish writes {MANIFEST})"
    )


def read_manifest(folder: str | Path) -> PreparedManifest:
    """The manifest of the prepared source in ``folder``, checked against the files there.

    Raises:
        UserError: no such folder; no manifest (not a prepared source, or a preparation not finished:
            with ``--part`` manifests, which parts are done and which missing), an unreadable
            or foreign one, a part missing or of another size than the manifest says, or a
            fingerprint that does not match the parts; each names the folder and the fix.
    """
    folder = Path(folder)
    where = display_path(folder)
    path = folder / MANIFEST
    if not folder.exists():
        raise UserError(f"{where}: does not exist; give the folder `cembed prepare-data CONFIG --output DIR` wrote")
    if not folder.is_dir():
        raise UserError(f"{where}: not a folder; a prepared source is the folder `cembed prepare-data` wrote")
    if not path.is_file() and (parts := _parts_message(folder, where)) is not None:
        raise UserError(parts)
    if not path.is_file():
        raise UserError(
            f"{where}: not a prepared source (no {MANIFEST}; a preparation still running or killed leaves "
            "none): prepare it with `cembed prepare-data CONFIG --output DIR`"
        )
    try:
        raw = json.loads(path.read_text())
        if raw.get("format") != FORMAT:
            raise ValueError(f"format {raw.get('format')!r}, expected {FORMAT!r}")
        if raw.get("version") not in READS:
            raise ValueError(f"version {raw.get('version')!r}, this cembed reads {' and '.join(map(str, READS))}")
        raw["parts"] = [PreparedPart(**p) for p in raw["parts"]]
        raw["source_prompts"] = [PromptedRows(**g) for g in raw.get("source_prompts") or []]
        manifest = PreparedManifest(**raw)
    except (ValueError, TypeError, KeyError) as err:
        raise UserError(
            f"{display_path(path)}: unreadable prepared-source manifest ({err}); prepare it again"
        ) from None
    for part in manifest.parts:
        file = folder / part.file
        if not file.is_file():
            raise UserError(f"{where}: part {part.file} is missing; copy the whole folder or prepare it again")
        size = file.stat().st_size
        if size != part.bytes:
            raise UserError(
                f"{where}: part {part.file} is {size} bytes, the manifest says {part.bytes}; "
                "copy the whole folder or prepare it again"
            )
    if sum(p.rows for p in manifest.parts) != manifest.rows:
        raise UserError(f"{display_path(path)}: the parts' rows do not add up to {manifest.rows}; prepare it again")
    if parts_fingerprint(manifest) != manifest.fingerprint:
        raise UserError(f"{display_path(path)}: fingerprint does not match the parts; prepare it again")
    return manifest


def read_parts(folder: str | Path, manifest: PreparedManifest):
    """The rows of the prepared folder ``folder`` whose manifest is ``manifest`` (from
    :func:`read_manifest`): each part memory-mapped (``datasets.Dataset.from_file``, no copy),
    concatenated in the manifest's order, as one ``datasets.Dataset``. The one reader of the format:
    the ``prepared`` source kind (:func:`cembed.data.sources.prepared.load_prepared`) and the tokenize
    cache (:func:`cembed.data.tokens.tokenize.pretokenize`) both read through it.

    Raises:
        UserError: no part; a part that is not an Arrow stream, holds other rows than the manifest
            says, lacks a role's ``<role>_input_ids`` column or has other columns than the first
            part's (naming the part).
    """
    import datasets

    folder = Path(folder)
    parts = []
    for part in manifest.parts:
        where = f"{display_path(folder)}: part {part.file}"
        try:
            table = datasets.Dataset.from_file(str(folder / part.file), in_memory=False)
        except Exception as err:  # pyarrow's ArrowInvalid and others: not an Arrow stream
            raise UserError(f"{where}: not an Arrow stream file ({first_line(err, 200)}); prepare it again") from None
        if len(table) != part.rows:
            raise UserError(f"{where}: holds {len(table)} rows, the manifest says {part.rows}; prepare it again")
        missing = [c + TOKEN_SUFFIX for c in manifest.columns if c + TOKEN_SUFFIX not in table.column_names]
        if missing:
            raise UserError(
                f"{where}: no column {missing[0]} (columns: {', '.join(table.column_names)}); prepare it again"
            )
        parts.append(table)
    if not parts:
        raise UserError(f"{display_path(folder)}: the prepared source has no parts; nothing to train on")
    for part, table in zip(manifest.parts, parts):
        if table.features != parts[0].features:
            raise UserError(
                f"{display_path(folder)}: part {part.file}'s columns ({', '.join(table.column_names)}) differ from "
                f"{manifest.parts[0].file}'s ({', '.join(parts[0].column_names)}); prepare it again"
            )
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def read_folder(folder: str | Path):
    """``(manifest, rows)`` of the prepared folder ``folder``: :func:`read_manifest`, then
    :func:`read_parts`. Raises what they raise."""
    manifest = read_manifest(folder)
    return manifest, read_parts(folder, manifest)
