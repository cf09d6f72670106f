"""Differential property test of the file readers (issue 32 item 12a, for items 1 and 2): generated
JSON Lines, CSV, TSV and parquet shards (plain or compressed: gzip, bzip2, xz, Zstandard, mixed in one folder; a BOM, CRLF, quoted line breaks and tabs, NA-like words,
empty cells, unicode) in a tree with hidden and underscore-prefixed folders and files, markers and
0-row shards, each read by cembed (:func:`cembed.data.sources.registry.load_source`) and by a
reference that shares no code with it: which files, by ``datasets``' own data-files resolution
(:func:`datasets.data_files.resolve_pattern`; underscore-prefixed parts left out as Spark and Hadoop
do); their rows, by Python's ``csv`` and ``json`` and by pyarrow. The same rows are required."""

from __future__ import annotations

import bz2
import csv
import gzip
import io
import json
import lzma
import tempfile
from pathlib import Path, PurePosixPath

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cembed.config.sources import FileSource
from cembed.data.sources.registry import load_source

COLUMNS = ["anchor", "positive"]
NA_WORDS = ["NA", "null", "None", "", "nan", "N/A", "NULL", "#N/A"]
SUFFIX = {"jsonl": ".jsonl", "csv": ".csv", "tsv": ".tsv", "parquet": ".parquet"}
# The compressions a text shard may carry (issue 39 item 5), each read back by its own Python module.
COMPRESS = {
    "": bytes,
    ".gz": gzip.compress,
    ".bz2": bz2.compress,
    ".xz": lzma.compress,
    ".zst": lambda b: zstandard.ZstdCompressor().compress(b),
}
DECOMPRESS = {
    "": bytes,
    ".gz": gzip.decompress,
    ".bz2": bz2.decompress,
    ".xz": lzma.decompress,
    ".zst": lambda b: zstandard.ZstdDecompressor().decompressobj().decompress(b),
}


def _compression(path: Path) -> str:
    return next((c for c in COMPRESS if c and path.name.endswith(c)), "")


# Any character but surrogates and lone carriage returns (a CSV line break is written whole, \r\n or
# \n); tabs, quotes, commas, a BOM inside a text, line and paragraph separators, accents, CJK, emoji.
_CHARS = st.one_of(
    st.characters(blacklist_categories=("Cs", "Cc")),
    st.sampled_from(['"', ",", "\t", "\n", " ", "\ufeff", "\u2028", "\u00a0", "é", "中", "😀", "\\"]),
)
_TEXT = st.one_of(
    st.sampled_from(NA_WORDS),
    st.text(_CHARS, max_size=10),
    st.text(_CHARS, max_size=5).map(lambda t: t + "\r\n" + t),  # a quoted CRLF inside a cell
)


def _cell(fmt: str):
    if fmt == "tsv":  # a TSV cell is its bytes between tabs: no tab or line break can be in one
        return _TEXT.map(lambda t: t.replace("\t", " ").replace("\r", "").replace("\n", " "))
    return _TEXT


@st.composite
def shard_trees(draw):
    """``(format, {relative path: rows or None (a marker file)}, options)``: one to three real
    shards (some in sub-folders), decoys in hidden and underscore-prefixed folders and files, and
    maybe a 0-row shard; options: a BOM, CRLF, a trailing line break, quoting everything."""
    fmt = draw(st.sampled_from(list(SUFFIX)))
    rows = st.lists(st.fixed_dictionaries({c: _cell(fmt) for c in COLUMNS}), min_size=1, max_size=6)
    names = st.text("abcdefghij0123456789-", min_size=1, max_size=6)
    suffix = SUFFIX[fmt]
    tree: dict[str, list | None] = {}
    for k in range(draw(st.integers(1, 3))):
        folder = draw(st.sampled_from(["", "sub/", "day=1/", "a/b/"]))
        packed = draw(st.sampled_from(list(COMPRESS))) if fmt != "parquet" else ""  # shards may mix them
        tree[f"{folder}part-{k}-{draw(names)}{suffix}{packed}"] = draw(rows)
    for decoy in draw(st.lists(st.sampled_from(["hidden", "underscore", "marker", "empty"]), max_size=4)):
        at = draw(names)
        if decoy == "hidden":
            tree[
                draw(st.sampled_from([f".{at}/part{suffix}", f".{at}{suffix}", f"sub/.ipynb_checkpoints/{at}{suffix}"]))
            ] = draw(rows)
        elif decoy == "underscore":
            tree[draw(st.sampled_from([f"_temporary/0/{at}{suffix}", f"_{at}{suffix}", f"sub/_{at}/p{suffix}"]))] = (
                draw(rows)
            )
        elif decoy == "marker":
            tree[draw(st.sampled_from(["_SUCCESS", f"{at}.crc", f".{at}{suffix}.crc", "README.md"]))] = None
        else:
            tree[f"part-9-{at}{suffix}"] = []
    options = {
        "bom": fmt != "parquet" and draw(st.booleans()),
        "crlf": draw(st.booleans()),
        "last_newline": draw(st.booleans()),
        "quote_all": draw(st.booleans()),
    }
    return fmt, tree, options


def _write(path: Path, fmt: str, rows: list[dict], options: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        schema = pa.schema([(c, pa.string()) for c in COLUMNS])
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
        return
    end = "\r\n" if options["crlf"] else "\n"
    if fmt == "jsonl":
        text = "".join(json.dumps(r, ensure_ascii=options["quote_all"]) + end for r in rows)
    elif fmt == "csv":
        out = io.StringIO()
        quoting = csv.QUOTE_ALL if options["quote_all"] else csv.QUOTE_MINIMAL
        writer = csv.DictWriter(out, COLUMNS, lineterminator=end, quoting=quoting)
        writer.writeheader()
        writer.writerows(rows)
        text = out.getvalue()
    else:
        text = "".join("\t".join(r[c] for c in COLUMNS) + end for r in [dict(zip(COLUMNS, COLUMNS)), *rows])
    if rows and not options["last_newline"]:
        text = text.removesuffix(end)
    path.write_bytes(COMPRESS[_compression(path)]((b"\xef\xbb\xbf" if options["bom"] else b"") + text.encode()))


def _reference_files(folder: Path) -> list[Path]:
    """The data files ``datasets``' own resolution finds in ``folder`` (hidden ones left out), less
    those under an underscore-prefixed name and those of another type, in path order."""
    from datasets.data_files import resolve_pattern

    found = [Path(p) for p in resolve_pattern(str(folder / "**"), base_path=str(folder))]
    keep = [
        p
        for p in found
        if not any(part.startswith("_") for part in PurePosixPath(p.relative_to(folder).as_posix()).parts)
        and p.name.endswith(tuple(s + c for s in SUFFIX.values() for c in COMPRESS))
    ]
    return sorted(keep)


def _reference_rows(path: Path, fmt: str) -> list[dict]:
    """A file's rows read with Python's ``csv``/``json`` or pyarrow; an empty CSV/TSV cell is
    missing (None), as the only missing value a text file can write."""
    if fmt == "parquet":
        return pq.read_table(path).select(COLUMNS).to_pylist()
    text = DECOMPRESS[_compression(path)](path.read_bytes()).decode("utf-8-sig")  # a cell keeps its \r\n
    if fmt == "jsonl":
        return [json.loads(line) for line in text.split("\n") if line.strip()]  # JSON Lines end in \n alone
    quoting = csv.QUOTE_NONE if fmt == "tsv" else csv.QUOTE_MINIMAL
    records = [
        r
        for r in csv.reader(io.StringIO(text, newline=""), delimiter="\t" if fmt == "tsv" else ",", quoting=quoting)
        if r
    ]
    header, body = records[0], records[1:]
    return [{c: (v if v != "" else None) for c, v in zip(header, r)} for r in body]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(shard_trees())
def test_cembed_reads_what_the_reference_reads(case):
    fmt, tree, options = case
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "data"
        for rel, rows in tree.items():
            path = folder / rel
            if rows is None:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(b"\x00marker")
            else:
                _write(path, fmt, rows, options)
        files = [f for f in _reference_files(folder) if _reference_rows(f, fmt)]  # 0-row shards: skipped
        # The reference agrees with what was generated: the real shards in path order, their rows
        # (an empty CSV/TSV cell is missing), so it is a reference and not a second copy of a bug.
        real = sorted(folder / rel for rel, rows in tree.items() if rows and Path(rel).name.startswith("part-"))
        real = [p for p in real if not any(part.startswith((".", "_")) for part in p.relative_to(folder).parts)]
        assert files == real
        expected = [row for f in files for row in _reference_rows(f, fmt)]
        blank = (lambda v: v if v != "" else None) if fmt in ("csv", "tsv") else (lambda v: v)
        generated = [
            {c: blank(v) for c, v in row.items()} for f in real for row in tree[f.relative_to(folder).as_posix()]
        ]
        assert expected == generated
        got = load_source(FileSource(path=str(folder))).select_columns(COLUMNS).to_list()
        assert got == expected
