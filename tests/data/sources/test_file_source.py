"""Text files read as the file says (cembed.data.sources.registry): a TSV cell is exactly its bytes between
tabs (no quote processing), no CSV/TSV cell is taken as missing for spelling a pandas NA word, and a
malformed or empty cell is named by its file and line."""

from __future__ import annotations

import pytest

from cembed.config.file import load_config
from cembed.errors import UserError
from cembed.train.recipe import check_run_inputs

# pandas' default NA words (read_csv's STR_NA_VALUES): each is a text like any other.
NA_WORDS = ["nan", "NaN", "-nan", "None", "NA", "N/A", "n/a", "null", "NULL", "<NA>", "#N/A", "1.#QNAN", "-NaN"]


def _train(write_config, path, bs=4):
    cfg = {"data": {"train": str(path)}, "batch": {"per_device_train_batch_size": bs, "mini_batch_size": 2}}
    _, data = check_run_inputs(load_config(write_config(cfg)))
    return data


def test_tsv_cells_are_their_bytes(write_config, tmp_path):
    # The quotes are part of the text: a CSV reader with quoting on read the first cell as
    # `quiet street at night` and the unbalanced one as the start of a multi-line field.
    cells = ['"quiet" street at night', '"unbalanced start', 'a "quoted" word', '""', "it's", 'end"']
    rows = [(c, f"answer {i}") for i, c in enumerate(cells)] + [(f"q {i}", f"a {i}") for i in range(4)]
    path = tmp_path / "pairs.tsv"
    path.write_text("anchor\tpositive\n" + "".join(f"{a}\t{p}\n" for a, p in rows))
    data = _train(write_config, path)
    assert data.dataset["anchor"] == [a for a, _ in rows]
    assert data.dataset["positive"] == [p for _, p in rows]


@pytest.mark.parametrize("suffix", [".tsv", ".csv"])
def test_na_words_stay_text(write_config, tmp_path, suffix):
    sep = "\t" if suffix == ".tsv" else ","
    path = tmp_path / f"pairs{suffix}"
    path.write_text(f"anchor{sep}positive\n" + "".join(f"{w}{sep}answer to {w}\n" for w in NA_WORDS))
    data = _train(write_config, path)
    assert data.rows_dropped == 0 and data.dataset["anchor"] == NA_WORDS
    assert data.sources[0].files is None  # one file: no shard count in the summary


@pytest.mark.parametrize("suffix", [".tsv", ".csv"])
def test_numbers_stay_text(write_config, tmp_path, suffix):
    # A column of digits is text as written ("007" is not 7): a text file carries no types.
    sep = "\t" if suffix == ".tsv" else ","
    path = tmp_path / f"pairs{suffix}"
    path.write_text(f"anchor{sep}positive\n" + "".join(f"00{i}{sep}answer {i}\n" for i in range(6)))
    assert _train(write_config, path).dataset["anchor"] == [f"00{i}" for i in range(6)]


def test_tsv_wrong_field_count_on_its_line_with_tsv_advice(write_config, tmp_path):
    # Line 3 opens a quote it never closes (fine in TSV); line 6 has a tab inside a cell.
    lines = ["anchor\tpositive", "q 0\ta 0", '"q 1\ta 1', "q 2\ta 2", "q 3\ta 3", "q 4\ta\t4", "q 5\ta 5"]
    path = tmp_path / "pairs.tsv"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError) as err:
        _train(write_config, path)
    message = str(err.value)
    assert message.startswith(f"{path}: line 6: 3 fields, but the header has 2 (anchor, positive)")
    assert "TSV has no quoting" in message and "quote fields" not in message


def test_csv_unclosed_quote_is_named_where_it_opens(write_config, tmp_path):
    lines = ["anchor,positive", "q 0,a 0", 'q 1,"a 1', "q 2,a 2", "q 3,a 3"]
    path = tmp_path / "pairs.csv"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError, match=r"pairs\.csv: line 3: a quote opened in this row is never closed"):
        _train(write_config, path)


def test_tsv_bad_utf8_on_its_line(write_config, tmp_path):
    path = tmp_path / "pairs.tsv"
    path.write_bytes(b"anchor\tpositive\n" + b"".join(b"q %d\ta %d\n" % (i, i) for i in range(4)) + b"q\xff\ta\n")
    with pytest.raises(UserError, match=r"pairs\.tsv: line 6: bytes that are not UTF-8 at column 2"):
        _train(write_config, path)


@pytest.mark.parametrize("suffix", [".tsv", ".csv"])
def test_empty_cell_named_by_file_line_and_column(write_config, tmp_path, suffix):
    # Still refused as an empty cell, named by the file's line (a blank line and, in the CSV, a
    # quoted line break before it: line 9, where row 6 starts), not a row number.
    sep = "\t" if suffix == ".tsv" else ","
    first = 'q 0,"two\nlines"\n' if suffix == ".csv" else "q 0\tone line\n\n"
    body = first + "".join(f"q {i}{sep}a {i}\n" for i in range(1, 5)) + "\n" + f"q 5{sep}\n" + f"q 6{sep}a 6\n"
    path = tmp_path / f"pairs{suffix}"
    path.write_text(f"anchor{sep}positive\n" + body)
    with pytest.raises(UserError) as err:
        _train(write_config, path)
    assert str(err.value).startswith(f"{path}: line 9: column 'positive' (role positive) is empty (null/NaN)")


def test_duplicate_header_names_refused(write_config, tmp_path):
    path = tmp_path / "pairs.tsv"
    path.write_text("anchor\tpositive\tpositive\n" + "".join(f"q {i}\ta {i}\tb {i}\n" for i in range(4)))
    with pytest.raises(UserError, match=r"pairs\.tsv: line 1: column name 'positive' appears twice"):
        _train(write_config, path)


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_a_local_file_asks_the_network_nothing(write_config, tmp_path, monkeypatch, suffix):
    # datasets pings the hub to count a download of its builder on each load when not offline
    # (datasets.load.increase_load_count: a HEAD with a 3 s timeout); for a local file cembed turns
    # that off, so a run without network and without HF_HUB_OFFLINE waits on no timeout.
    import datasets
    import datasets.load

    pings = []

    class Session:
        def head(self, url, **kwargs):
            pings.append(url)

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_UPDATE_DOWNLOAD_COUNTS", True)
    monkeypatch.setattr(datasets.load, "get_session", Session)
    path = tmp_path / f"pairs{suffix}"
    rows = [(f"q {i}", f"a {i}") for i in range(8)]
    if suffix == ".csv":
        path.write_text("anchor,positive\n" + "".join(f"{a},{p}\n" for a, p in rows))
    else:
        path.write_text("".join(f'{{"anchor": "{a}", "positive": "{p}"}}\n' for a, p in rows))
    assert len(_train(write_config, path).dataset) == 8
    assert pings == []


def _load(path):
    from cembed.config.sources import FileSource
    from cembed.data.sources.registry import load_source

    return load_source(FileSource(path=str(path)))


def test_a_missing_or_empty_file_is_named(tmp_path):
    with pytest.raises(UserError) as err:
        _load(tmp_path / "pairs.jsonl")
    assert (
        str(err.value)
        == f"{tmp_path / 'pairs.jsonl'}: data file not found (data paths resolve relative to the config file)"
    )
    (tmp_path / "pairs.jsonl").write_bytes(b"")
    with pytest.raises(UserError) as err:
        _load(tmp_path / "pairs.jsonl")
    assert str(err.value) == f"{tmp_path / 'pairs.jsonl'}: data file is empty"


def test_a_file_of_another_type_is_refused_naming_the_types_read():
    from pathlib import Path

    from cembed.data.sources.file_kind import builder_for

    with pytest.raises(UserError) as err:
        builder_for(Path("data/notes.txt"))
    assert str(err.value) == (
        "data/notes.txt: unsupported file type; use .jsonl, .json, .csv, .tsv (each also .gz, .bz2, .xz or .zst) "
        "or .parquet"
    )


def test_bad_utf8_in_a_jsonl_string_or_a_csv_header_is_named_on_its_line(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_bytes(b'{"anchor": "a", "positive": "p"}\n{"anchor": "a\xff", "positive": "p"}\n')
    with pytest.raises(UserError) as err:
        _load(path)
    assert str(err.value) == f"{path}: line 2: bytes that are not UTF-8 at column 14; re-encode the file as UTF-8"
    path = tmp_path / "pairs.csv"
    path.write_bytes(b"anc\xffhor,positive\nq,a\n")
    with pytest.raises(UserError) as err:
        _load(path)
    assert str(err.value) == f"{path}: line 1: bytes that are not UTF-8 at column 4; re-encode the file as UTF-8"


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_jsonl_with_a_blank_line_and_a_non_text_cell_reads_every_row(tmp_path, suffix):
    # datasets' reader fails on this mix; the rows are read as written, the number kept for the cell
    # checks to name.
    import gzip
    import json

    rows = [{"anchor": 5 if i == 1 else f"q {i}", "positive": f"a {i}"} for i in range(4)]
    text = json.dumps(rows[0]) + "\n\n" + "".join(json.dumps(r) + "\n" for r in rows[1:])
    path = tmp_path / f"pairs{suffix}"
    path.write_bytes(gzip.compress(text.encode()) if suffix.endswith(".gz") else text.encode())
    assert _load(path).to_list() == rows
