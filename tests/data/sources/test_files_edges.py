"""Data as pipelines leave it (issue 32 items 1 and 2): a folder written by Spark, Hadoop or Jupyter
reads only its real parts (hidden and underscore-prefixed folders and files skipped, with the list of
what was skipped), an Excel CSV (BOM, CRLF) reads as the same data saved plainly, a 0-row shard is
skipped with a note, a streamed source gets the shard checks a loaded one gets, and a shard the
libraries cannot read is named in one line that keeps their cause."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import spark_folder, write_rows
from safetensors.torch import load_file as load_weights

from cembed.config.file import config_from_dict
from cembed.config.sources import FileSource
from cembed.data.sources.registry import load_source, read_head
from cembed.errors import UserError
from cembed.train.recipe import check_run_inputs, run_training

GENERIC = "An error occurred while generating the dataset"


def _refusal(read, *args) -> str:
    """The one-line message of the UserError ``read(*args)`` raises."""
    with pytest.raises(UserError) as err:
        read(*args)
    return str(err.value)


def _rows(n: int, tag: str = "") -> list[dict]:
    # Anchors repeat, so the no-duplicates sampler's batches depend on which rows the source holds.
    return [{"anchor": f"topic {i % 13}{tag}", "positive": f"passage number {i}{tag}"} for i in range(n)]


def _config(model_dir: Path, tmp_path: Path, train, out: str, steps: int = 4) -> dict:
    return {
        "model": {"name_or_path": str(model_dir), "device": "cpu"},
        "data": {"train": train, "cache_dir": str(tmp_path / "cache")},
        "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
        "optim": {"learning_rate": 1e-3, "base_batch_size": 8},
        "train": {"max_steps": steps, "logging_steps": 1, "output_dir": str(tmp_path / out), "seed": 5},
    }


def _train(model_dir: Path, tmp_path: Path, train, out: str):
    """``(data, run summary, weights)`` of a 4-step run on ``train``."""
    cfg = config_from_dict(_config(model_dir, tmp_path, train, out), base=tmp_path)
    plan, data = check_run_inputs(cfg)
    summary = run_training(cfg, plan, data)
    return data, summary, load_weights(str(tmp_path / out / "model.safetensors"))


def _same_run(a, b) -> None:
    (_, sa, wa), (_, sb, wb) = a, b
    assert [s for s, _ in sa["step_losses"]] == [1, 2, 3, 4]
    assert [v for _, v in sa["step_losses"]] == [v for _, v in sb["step_losses"]]
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) <= 1e-6


def _skipped(ext: str) -> list[str]:
    """What :func:`spark_folder` holds that is not data, as the source lists it."""
    return [
        ".ipynb_checkpoints/ (hidden folder, 1 file)",
        f".part-00000-a1b2{ext}.crc (hidden)",
        "_SUCCESS (underscore-prefixed: Spark/Hadoop bookkeeping)",
        "_temporary/ (underscore-prefixed folder: Spark/Hadoop bookkeeping, 1 file)",
        "part-00000.crc (not a data file)",
        f"part-00002-a1b2{ext} (0 rows)",
    ]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_spark_folder_reads_its_real_rows_and_lists_what_it_skipped(write_config, tmp_path, fmt):
    rows = _rows(40)
    spark_folder(tmp_path / "job", rows, fmt)
    cfg = {"data": {"train": "job"}, "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4}}
    data = check_run_inputs(config_from_dict(cfg, base=tmp_path))[1]
    assert data.rows_read == 40 and data.dataset.to_list() == rows
    src = data.sources[0]
    assert src.files == 2 and list(src.skipped) == _skipped(".snappy.parquet" if fmt == "parquet" else ".json")


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_spark_folder_trains_exactly_as_the_concatenated_file(tiny_model_dir, tmp_path, fmt):
    rows = _rows(40)
    spark_folder(tmp_path / "job", rows, fmt)
    whole = write_rows(tmp_path / f"all.{fmt}", rows, fmt)
    folder = _train(tiny_model_dir, tmp_path, "job", "from-folder")
    _same_run(folder, _train(tiny_model_dir, tmp_path, str(whole), "from-file"))
    data, summary, _ = folder
    assert data.rows_read == 40 and data.dataset["positive"] == [r["positive"] for r in rows]
    entry = summary["data"]["sources"][0]
    assert entry["rows_read"] == 40 and entry["files"] == 2
    assert entry["skipped"] == _skipped(".snappy.parquet" if fmt == "parquet" else ".json")


def test_a_recursive_glob_skips_hidden_and_underscore_folders_unless_it_names_them(write_config, tmp_path):
    rows = _rows(40)
    spark_folder(tmp_path / "job", rows)
    write_rows(tmp_path / "job" / "day=2" / "part-00000.json", _rows(3, " day 2"), "jsonl")
    got = load_source(FileSource(path=str(tmp_path / "job" / "**" / "*.json")))
    assert got["positive"] == [r["positive"] for r in _rows(3, " day 2") + rows]  # path order: day=2/ first
    # A pattern that names the underscore folder reads it, as datasets reads a hidden folder it is asked for.
    named = load_source(FileSource(path=str(tmp_path / "job" / "_temporary" / "**" / "*.json")))
    assert named["positive"] == [r["positive"] for r in rows[20:]]


def _excel_csv(path: Path, rows: list[dict], excel: bool) -> Path:
    """``rows`` as CSV; ``excel``: as Excel's "CSV UTF-8" saves it (a BOM, CRLF line ends)."""
    with open(path, "w", encoding="utf-8-sig" if excel else "utf-8", newline="") as f:
        writer = csv.DictWriter(f, ["anchor", "positive"], lineterminator="\r\n" if excel else "\n")
        writer.writeheader()
        writer.writerows(rows)
    return path


def _excel_rows() -> list[dict]:
    rows = _rows(40)
    rows[3]["positive"] = 'a "quoted", comma and\r\na line break'
    rows[7]["anchor"] = "café 中文 NA"
    return rows


def test_an_excel_csv_with_bom_and_crlf_reads_as_the_plain_file(tmp_path):
    rows = _excel_rows()
    excel = _excel_csv(tmp_path / "excel.csv", rows, excel=True)
    assert excel.read_bytes().startswith(b"\xef\xbb\xbfanchor,positive\r\n")
    plain = _excel_csv(tmp_path / "plain.csv", rows, excel=False)
    assert load_source(FileSource(path=str(excel))).to_list() == load_source(FileSource(path=str(plain))).to_list()
    cfg = {"data": {"train": str(excel)}, "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4}}
    data = check_run_inputs(config_from_dict(cfg, base=tmp_path))[1]
    assert data.dataset.to_list() == rows and data.roles == {"anchor": "anchor", "positive": "positive"}


@pytest.mark.slow
def test_an_excel_csv_with_bom_and_crlf_trains_as_the_plain_file(tiny_model_dir, tmp_path):
    rows = _excel_rows()
    excel = _excel_csv(tmp_path / "excel.csv", rows, excel=True)
    plain = _excel_csv(tmp_path / "plain.csv", rows, excel=False)
    a = _train(tiny_model_dir, tmp_path, str(excel), "excel")
    _same_run(a, _train(tiny_model_dir, tmp_path, str(plain), "plain"))
    assert a[0].dataset.to_list() == rows and a[0].roles == {"anchor": "anchor", "positive": "positive"}


def test_a_bom_shard_beside_a_plain_one_is_one_source(tmp_path):
    rows = _rows(20)
    (tmp_path / "csv").mkdir()
    _excel_csv(tmp_path / "csv" / "a.csv", rows[:10], excel=False)
    _excel_csv(tmp_path / "csv" / "b.csv", rows[10:], excel=True)
    assert load_source(FileSource(path=str(tmp_path / "csv"))).to_list() == rows
    # JSON Lines with a BOM (Notepad's UTF-8) and CRLF, beside a plain shard.
    (tmp_path / "jsonl").mkdir()
    (tmp_path / "jsonl" / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:10]))
    text = "".join(json.dumps(r) + "\r\n" for r in rows[10:])
    (tmp_path / "jsonl" / "b.jsonl").write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert load_source(FileSource(path=str(tmp_path / "jsonl"))).to_list() == rows


EMPTY_SHARDS = {
    "jsonl, 0 bytes": ("x.jsonl", b""),
    "jsonl, blank lines": ("x.jsonl", b"\n\r\n\n"),
    "csv, 0 bytes": ("x.csv", b""),
    "csv, header alone": ("x.csv", b"\xef\xbb\xbfanchor,positive\r\n"),
    "tsv, header alone": ("x.tsv", b"anchor\tpositive\n"),
    "parquet, 0 rows": ("x.parquet", None),
    "parquet, 0 bytes": ("x.parquet", b""),
    "json, an empty list": ("x.json", b"[]\n"),
}


@pytest.mark.parametrize("case", list(EMPTY_SHARDS))
def test_a_zero_row_shard_is_skipped_with_a_note(tmp_path, case):
    name, content = EMPTY_SHARDS[case]
    suffix = Path(name).suffix
    rows = _rows(12)
    folder = tmp_path / "parts"
    folder.mkdir()
    for k, part in enumerate([rows[:6], rows[6:]]):
        path = folder / f"part-{2 * k}{suffix}"
        if suffix == ".parquet":
            pq.write_table(pa.Table.from_pylist(part), path)
        elif suffix in (".jsonl", ".json"):
            path.write_text("".join(json.dumps(r) + "\n" for r in part))
        else:
            sep = "," if suffix == ".csv" else "\t"
            path.write_text(f"anchor{sep}positive\n" + "".join(f"{r['anchor']}{sep}{r['positive']}\n" for r in part))
    empty = folder / f"part-1{suffix}"  # between the two real parts
    if content is None:
        pq.write_table(
            pa.Table.from_pylist([], schema=pa.schema([("anchor", pa.string()), ("positive", pa.string())])), empty
        )
    else:
        empty.write_bytes(content)
    source = FileSource(path=str(folder))
    assert load_source(source).to_list() == rows
    from cembed.data.sources.file_kind import resolve_shards

    shards = resolve_shards(source)
    assert [p.name for p in shards.files] == [f"part-0{suffix}", f"part-2{suffix}"]
    assert shards.skipped == (f"part-1{suffix} (0 rows)",)
    # Listed shards too; and a source whose every shard holds 0 rows is refused naming it.
    listed = FileSource(path=[str(folder / f"part-{k}{suffix}") for k in range(3)])
    assert load_source(listed).to_list() == rows
    message = _refusal(load_source, FileSource(path=[str(empty), str(empty)]))
    assert "every data file holds 0 rows" in message and "\n" not in message, message


def _stream_config(tmp_path: Path, model_dir: Path, folder: Path) -> dict:
    return {
        "model": {"name_or_path": str(model_dir), "device": "cpu"},
        "data": {"train": {"path": str(folder), "streaming": {"check_rows": 20}}},
        "batch": {"per_device_train_batch_size": 4, "mini_batch_size": 2},
        "train": {"max_steps": 2, "output_dir": str(tmp_path / "out")},
    }


def test_a_streamed_shard_with_another_column_is_refused_naming_it(tiny_model_dir, tmp_path):
    rows = _rows(40)
    folder = tmp_path / "stream"
    write_rows(folder / "part-0.jsonl", rows[:20], "jsonl")
    write_rows(folder / "part-1.jsonl", [dict(r, extra="x") for r in rows[20:]], "jsonl")
    cfg = config_from_dict(_stream_config(tmp_path, tiny_model_dir, folder), base=tmp_path)
    message = _refusal(check_run_inputs, cfg)
    assert "part-1.jsonl: columns anchor, positive, extra differ from" in message and "part-0.jsonl" in message
    assert "\n" not in message, message


@pytest.mark.parametrize("streaming", [False, True])
def test_a_shard_the_libraries_cannot_read_is_named_with_their_cause(tmp_path, streaming):
    rows = _rows(40)
    folder = tmp_path / "parts"
    write_rows(folder / "part-0.parquet", rows[:20], "parquet")
    write_rows(folder / "part-1.parquet", rows[20:], "parquet")
    (folder / "part-2.parquet").write_bytes(b"PAR1 not a parquet file, cut off")
    source = FileSource(path=str(folder), streaming={} if streaming else None)
    message = _refusal(read_head, source, 100) if streaming else _refusal(load_source, source)
    assert "part-2.parquet: cannot read as " in message and "Parquet magic bytes not found" in message, message
    assert GENERIC not in message and "\n" not in message, message


def test_a_streamed_jsonl_shard_cut_off_is_named_with_the_line_cause(tmp_path):
    folder = tmp_path / "parts"
    write_rows(folder / "part-0.jsonl", _rows(20), "jsonl")
    (folder / "part-1.jsonl").write_text(json.dumps(_rows(1)[0]) + '\n{"anchor": "cut off", "positive": \n')
    message = _refusal(read_head, FileSource(path=str(folder), streaming={}), 100)
    assert "part-1.jsonl: cannot read as a stream: JSON parse error" in message and "\n" not in message, message


def test_shards_whose_column_types_differ_are_named(tmp_path):
    folder = tmp_path / "parts"
    write_rows(folder / "part-0.parquet", _rows(10), "parquet")
    pq.write_table(
        pa.Table.from_pylist([{"anchor": [i], "positive": f"p {i}"} for i in range(5)]), folder / "part-1.parquet"
    )
    message = _refusal(load_source, FileSource(path=str(folder)))
    assert "part-1.parquet: column types (anchor: list of int64, positive: string) differ from" in message, message
    assert "part-0.parquet's (anchor: string, positive: string)" in message and GENERIC not in message, message


# --- the shard helpers' own answers (written against `make mutate`'s survivors).


def test_every_shard_empty_is_refused_counting_the_files_and_naming_the_skipped(tmp_path):
    from cembed.data.sources.file_kind import without_empty_shards

    empty = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for path in empty:
        path.write_bytes(b"")
    assert (
        _refusal(without_empty_shards, empty, ["notes.txt (not a data file)"], "data/p")
        == "data/p: every data file holds 0 rows (2 files); skipped: notes.txt (not a data file)"
    )
    assert _refusal(without_empty_shards, empty[:1], [], "data/p") == "data/p: every data file holds 0 rows (1 file)"


def test_an_empty_shard_is_named_under_its_folder(tmp_path):
    from cembed.data.sources.file_kind import without_empty_shards

    (tmp_path / "sub").mkdir()
    full, empty = tmp_path / "full.jsonl", tmp_path / "sub" / "e.jsonl"
    full.write_text('{"anchor": "a", "positive": "b"}\n')
    empty.write_text("\n\n")  # blank lines only: no row
    shards = without_empty_shards([full, empty], [], "data/p", base=tmp_path)
    assert shards.files == [full] and shards.skipped == ("sub/e.jsonl (0 rows)",)


def test_a_shards_format_and_a_patterns_literal_folder():
    from cembed.data.sources.file_kind import literal_prefix, shard_format

    formats = [shard_format(Path(n)) for n in ("a.json", "a.JSON.gz", "a.jsonl", "a.jsonl.gz", "a.parquet", "a.csv")]
    assert formats == [".jsonl", ".jsonl", ".jsonl", ".jsonl", ".parquet", ".csv"]
    assert literal_prefix("/d/x/**/*.jsonl") == str(Path("/d/x"))
    assert literal_prefix("/*/a.jsonl") == os.sep


def test_what_a_folder_skips_is_listed_by_file_or_by_folder_with_its_count(tmp_path):
    from cembed.data.sources.file_kind import resolve_shards

    folder = tmp_path / "job"
    write_rows(folder / "part-0.jsonl", _rows(3), "jsonl")
    for name in ("a", "b", "c"):
        write_rows(folder / ".hidden" / f"{name}.jsonl", _rows(1), "jsonl")
    write_rows(folder / ".hidden" / "__pycache__" / "d.jsonl", _rows(1), "jsonl")
    write_rows(folder / "__pycache__" / "x.jsonl", _rows(1), "jsonl")  # datasets' own rule, not a hidden one
    write_rows(folder / "_temporary" / "x.jsonl", _rows(1), "jsonl")
    (folder / "sub").mkdir()
    (folder / "sub" / ".part-0.jsonl.crc").write_text("crc")  # a hidden file in a folder that is not
    (folder / "sub" / "notes.txt").write_text("not data")
    shards = resolve_shards(FileSource(path=str(folder)))
    assert shards.files == [folder / "part-0.jsonl"]
    assert shards.skipped == (
        ".hidden/ (hidden folder, 4 files)",
        "__pycache__/x.jsonl (left out by datasets' data-files resolution)",
        "_temporary/ (underscore-prefixed folder: Spark/Hadoop bookkeeping, 1 file)",
        "sub/.part-0.jsonl.crc (hidden)",
        "sub/notes.txt (not a data file)",
    )
    # A glob naming the hidden folder reads it; what datasets leaves out there is not called hidden.
    named = resolve_shards(FileSource(path=str(folder / ".hidden" / "**" / "*.jsonl")))
    assert [p.name for p in named.files] == ["a.jsonl", "b.jsonl", "c.jsonl"]
    assert named.skipped == ("__pycache__/d.jsonl (left out by datasets' data-files resolution)",)


def test_a_folder_or_glob_without_data_names_what_it_skipped(tmp_path):
    from cembed.files import display_path

    folder = tmp_path / "job"
    folder.mkdir()
    (folder / ".part-0.crc").write_text("crc")
    (folder / ".part-1.crc").write_text("crc")
    assert _refusal(load_source, FileSource(path=str(folder))) == (
        f"{display_path(folder)}: the folder holds no .jsonl, .json, .csv, .tsv (each also .gz, .bz2, .xz or .zst) "
        "or .parquet file; skipped: .part-0.crc (hidden), .part-1.crc (hidden)"
    )
    pattern = str(folder / "*.parquet")
    assert _refusal(load_source, FileSource(path=pattern)) == (
        f"{display_path(pattern)}: no .jsonl, .json, .csv, .tsv (each also .gz, .bz2, .xz or .zst) or .parquet file "
        "matches this pattern"
    )


def test_a_folder_with_brackets_in_its_name_is_the_folder_not_a_pattern(tmp_path):
    folder = tmp_path / "shards[2024]"
    write_rows(folder / "part-0.jsonl", _rows(3), "jsonl")
    (tmp_path / "shards2").mkdir()  # what the name would match as a pattern
    assert load_source(FileSource(path=str(folder))).to_list() == _rows(3)


def test_a_list_naming_a_folder_is_refused_naming_it(tmp_path):
    from cembed.files import display_path

    write_rows(tmp_path / "a.jsonl", _rows(3), "jsonl")
    (tmp_path / "more").mkdir()
    assert (
        _refusal(load_source, FileSource(path=[str(tmp_path / "a.jsonl"), str(tmp_path / "more")]))
        == f"{display_path(tmp_path / 'more')}: is a folder; a list of shards names files"
    )


def test_every_shard_empty_names_the_source(tmp_path):
    from cembed.files import display_path

    folder = tmp_path / "parts"
    folder.mkdir()
    for name in ("part-0.jsonl", "part-1.jsonl"):
        (folder / name).write_text("\n")
    (folder / "_SUCCESS").write_text("")
    assert _refusal(load_source, FileSource(path=str(folder))) == (
        f"{display_path(folder)}: every data file holds 0 rows (2 files); "
        "skipped: _SUCCESS (underscore-prefixed: Spark/Hadoop bookkeeping)"
    )
    listed = FileSource(path=[str(folder / "part-0.jsonl"), str(folder / "part-1.jsonl")])
    assert _refusal(load_source, listed) == f"{display_path(listed.label)}: every data file holds 0 rows (2 files)"


def test_an_empty_listed_shard_is_skipped_by_its_path(tmp_path):
    from cembed.data.sources.file_kind import resolve_shards
    from cembed.files import display_path

    full = write_rows(tmp_path / "a.jsonl", _rows(3), "jsonl")
    empty = tmp_path / "b.jsonl"
    empty.write_text("")
    shards = resolve_shards(FileSource(path=[str(full), str(empty)]))
    assert shards.files == [full] and shards.skipped == (f"{display_path(empty)} (0 rows)",)


def test_a_shard_that_cannot_be_read_is_not_judged_empty(tmp_path):
    from cembed.data.sources.file_kind import without_empty_shards

    full = write_rows(tmp_path / "a.jsonl", _rows(3), "jsonl")
    gone = tmp_path / "b.jsonl"  # removed after the folder was listed: the load names it
    assert without_empty_shards([full, gone], [], "p").files == [full, gone]


def test_a_shard_rewritten_in_place_is_judged_again(tmp_path):
    from cembed.data.sources.file_kind import without_empty_shards

    full = write_rows(tmp_path / "a.jsonl", _rows(1), "jsonl")
    text = full.read_text()
    other = tmp_path / "b.jsonl"
    other.write_text(" " * (len(text) - 1) + "\n")  # blank: 0 rows, the same size as one row
    assert without_empty_shards([full, other], [], "p").files == [full]
    mtime = other.stat().st_mtime_ns
    other.write_text(text)
    os.utime(other, ns=(mtime + 10**9, mtime + 10**9))  # a later version, whatever the clock's resolution
    assert without_empty_shards([full, other], [], "p").files == [full, other]


def test_check_shards_names_a_vanished_shard_and_passes_over_unknown_columns(tmp_path):
    from cembed.data.sources.file_kind import check_shards
    from cembed.files import display_path

    a = write_rows(tmp_path / "a.jsonl", _rows(3), "jsonl")
    gone = tmp_path / "gone.jsonl"
    assert _refusal(check_shards, [a, gone], "src") == f"{display_path(gone)}: data file not found"
    # A first record that is not an object tells no columns: the next shards still must agree.
    odd = tmp_path / "0.jsonl"
    odd.write_text("[1, 2]\n")
    other = write_rows(tmp_path / "c.jsonl", [{"anchor": "q", "answer": "a"}], "jsonl")
    assert _refusal(check_shards, [odd, a, other], "src") == (
        f"src: {display_path(other)}: columns anchor, answer differ from {display_path(a)}'s (anchor, positive); "
        "every shard of one source needs the same columns"
    )


def test_mixed_formats_are_refused_naming_the_source_the_shard_and_the_first_shard(tmp_path):
    from cembed.files import display_path

    folder = tmp_path / "parts"
    write_rows(folder / "part-0.jsonl", _rows(3), "jsonl")
    write_rows(folder / "part-1.jsonl", _rows(3), "jsonl")
    write_rows(folder / "part-2.parquet", _rows(3), "parquet")
    assert _refusal(load_source, FileSource(path=str(folder))) == (
        f"{display_path(folder)}: {display_path(folder / 'part-2.parquet')}: a .parquet file among .jsonl files "
        f"({display_path(folder / 'part-0.jsonl')}); one source holds one format: convert it, or make the formats "
        "two sources"
    )


def test_parquet_shards_with_other_column_names_are_refused_before_reading(tmp_path):
    folder = tmp_path / "parts"
    write_rows(folder / "part-0.parquet", _rows(3), "parquet")
    pq.write_table(pa.Table.from_pylist([{"anchor": "q", "answer": "a"}]), folder / "part-1.parquet")
    message = _refusal(load_source, FileSource(path=str(folder)))
    assert "part-1.parquet: columns anchor, answer differ from " in message, message
    assert "part-0.parquet's (anchor, positive); every shard of one source needs the same columns" in message


@pytest.mark.parametrize(("cell", "shown"), [([1], "list of int64"), ({"text": "q"}, "dict")], ids=["list", "struct"])
def test_the_first_shard_whose_column_types_differ_is_named_with_its_types(tmp_path, cell, shown):
    from cembed.files import display_path

    folder = tmp_path / "parts"
    write_rows(folder / "part-0.parquet", _rows(4), "parquet")
    write_rows(folder / "part-1.parquet", _rows(4), "parquet")
    pq.write_table(pa.Table.from_pylist([{"anchor": cell, "positive": "p"}]), folder / "part-2.parquet")
    assert _refusal(load_source, FileSource(path=str(folder))) == (
        f"{display_path(folder)}: {display_path(folder / 'part-2.parquet')}: column types (anchor: {shown}, "
        f"positive: string) differ from {display_path(folder / 'part-0.parquet')}'s (anchor: string, positive: "
        "string); every shard of one source needs the same column types"
    )
