"""A sharded file source (issue 24 item 1): a folder, a glob or a list of files read as ONE source
(cembed.data.sources.file_kind.load_file), in path order, refused naming the first offending shard when the
shards do not agree, and a bad cell named by its shard and line."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from cembed.config.file import load_config
from cembed.errors import UserError
from cembed.train.recipe import check_run_inputs

SHARDS = 20
ROWS = 7  # per shard: 140 rows, batch 8 -> 17 full batches and a short one


def _rows(n: int = SHARDS * ROWS) -> list[dict]:
    # Some anchors repeat across shards, so the no-duplicates sampler has work to do and the batches
    # depend on which rows the source holds and in what order.
    return [{"anchor": f"topic {i % 37}", "positive": f"passage number {i}"} for i in range(n)]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in rows).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(text) if path.name.endswith(".gz") else text)
    return path


def _shards(folder: Path, rows: list[dict], suffix=".jsonl.gz") -> list[Path]:
    """Rows split into SHARDS files shard-00 .. shard-19 (odd shards plain .jsonl when suffix is None:
    .jsonl and .jsonl.gz are one format)."""
    paths = []
    for k in range(SHARDS):
        name = f"shard-{k:02d}" + (suffix or (".jsonl.gz" if k % 2 == 0 else ".jsonl"))
        paths.append(_write_jsonl(folder / name, rows[k * ROWS : (k + 1) * ROWS]))
    return paths


def _batches(tmp_path, tiny_model_dir, write_config, train) -> list[list[tuple[str, str]]]:
    """The batches (anchor, positive texts) the trainer's own data loader draws in epoch 1, seed 5,
    through the real path: config -> check_run_inputs -> build_components -> build_trainer."""
    import cembed.train.recipe as T

    out = tmp_path / f"run-{len(list(tmp_path.glob('run-*')))}"
    cfg = load_config(
        write_config(
            {
                "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
                "data": {"train": train, "cache_dir": str(tmp_path / "cache")},
                "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 8},
                "train": {"output_dir": str(out), "max_steps": 1, "seed": 5},
            }
        )
    )
    plan, data = T.check_run_inputs(cfg)
    parts = T.build_components(cfg, plan, data, "cpu")
    run = T.build_trainer(cfg, plan, parts, T.RunDir(out, None), T.QuietRunDisplay())
    sampler = run.trainer.get_train_dataloader().batch_sampler
    anchors, positives = data.dataset["anchor"], data.dataset["positive"]
    return [[(anchors[i], positives[i]) for i in batch] for batch in sampler]


def test_a_folder_glob_or_list_of_shards_trains_as_the_concatenated_file(tiny_model_dir, write_config, tmp_path):
    rows = _rows()
    whole = _write_jsonl(tmp_path / "all.jsonl", rows)
    # Named so that path order is row order (sub-folders: test_a_folder_in_a_subfolder_order_...).
    paths = _shards(tmp_path / "shards", rows, suffix=None)
    expected = _batches(tmp_path, tiny_model_dir, write_config, str(whole))
    assert len(expected) == 17 and sum(len(b) for b in expected) > 130
    assert _batches(tmp_path, tiny_model_dir, write_config, str(tmp_path / "shards")) == expected
    assert _batches(tmp_path, tiny_model_dir, write_config, "shards/shard-*.jsonl*") == expected  # relative glob
    assert _batches(tmp_path, tiny_model_dir, write_config, {"path": [str(p) for p in paths]}) == expected


def _load(write_config, train):
    cfg = {"data": {"train": train}, "batch": {"per_device_train_batch_size": 4, "mini_batch_size": 2}}
    return check_run_inputs(load_config(write_config(cfg)))[1]


def test_a_folder_in_a_subfolder_order_and_its_file_count(write_config, tmp_path):
    rows = _rows()
    for k in range(SHARDS):  # part-a/shard-00..09, part-b/shard-10..19: path order
        _write_jsonl(
            tmp_path / "data" / f"part-{'ab'[k // 10]}" / f"shard-{k:02d}.jsonl", rows[k * ROWS : (k + 1) * ROWS]
        )
    (tmp_path / "data" / "README.md").write_text("not data")  # not a data file: skipped
    (tmp_path / "data" / "_SUCCESS").write_text("")
    data = _load(write_config, "data")
    assert data.dataset["positive"] == [r["positive"] for r in rows]
    assert data.sources[0].files == SHARDS


def test_mixed_formats_refused_naming_the_shard(write_config, tmp_path):
    rows = _rows()
    _shards(tmp_path / "shards", rows, suffix=".jsonl")
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "shards" / "shard-04.jsonl").unlink()
    pq.write_table(pa.Table.from_pylist(rows[28:35]), tmp_path / "shards" / "shard-04.parquet")
    with pytest.raises(UserError) as err:
        _load(write_config, "shards")
    message = str(err.value)
    assert "shard-04.parquet" in message and ".jsonl" in message and "\n" not in message, message


def test_different_columns_refused_naming_the_first_shard_that_differs(write_config, tmp_path):
    rows = _rows()
    _shards(tmp_path / "shards", rows)
    _write_jsonl(tmp_path / "shards" / "shard-11.jsonl.gz", [{"query": "q", "positive": "p"}] * ROWS)
    _write_jsonl(tmp_path / "shards" / "shard-15.jsonl.gz", [{"text": "q", "positive": "p"}] * ROWS)
    with pytest.raises(UserError) as err:
        _load(write_config, "shards/*.jsonl.gz")
    message = str(err.value)
    assert "shard-11.jsonl.gz" in message and "shard-15" not in message and "query" in message, message
    assert "shard-00.jsonl.gz" in message and "\n" not in message, message


def test_a_bad_cell_is_named_by_its_shard_and_line(write_config, tmp_path):
    rows = _rows()
    rows[7 * ROWS + 3]["positive"] = ""  # shard 7, its 4th row: line 5 after a blank line
    paths = _shards(tmp_path / "shards", rows, suffix=".jsonl")
    text = paths[7].read_text().splitlines(keepends=True)
    paths[7].write_text("".join(text[:2]) + "\n" + "".join(text[2:]))
    with pytest.raises(UserError) as err:
        _load(write_config, "shards")
    message = str(err.value)
    assert "shard-07.jsonl: line 5:" in message and "empty" in message, message


def test_an_unreadable_shard_is_named(write_config, tmp_path):
    _shards(tmp_path / "shards", _rows())
    (tmp_path / "shards" / "shard-13.jsonl.gz").write_bytes(b"\x1f\x8b\x08 truncated")
    with pytest.raises(UserError, match=r"shard-13\.jsonl\.gz: corrupt or truncated gzip"):
        _load(write_config, "shards")


@pytest.mark.parametrize("train", ["nothing/*.jsonl", "empty", "empty/**/*.parquet"])
def test_a_pattern_or_folder_matching_no_file_is_named(write_config, tmp_path, train):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("not data")
    with pytest.raises(UserError) as err:
        _load(write_config, train)
    message = str(err.value)
    assert train in message and "no " in message and "\n" not in message, message


def test_a_missing_file_in_a_list_is_named(write_config, tmp_path):
    paths = _shards(tmp_path / "shards", _rows())
    with pytest.raises(UserError, match=r"shard-99\.jsonl: data file not found"):
        _load(write_config, {"path": [str(paths[0]), str(tmp_path / "shards" / "shard-99.jsonl")]})


def test_sharded_source_names(write_config, tmp_path):
    from cembed.config.sources import FileSource

    assert FileSource(path="data/shards").default_name() == "shards"
    assert FileSource(path="data/*.jsonl.gz").default_name() == "data"
    assert FileSource(path="/x/corpus/**/*.parquet").default_name() == "corpus"
    assert FileSource(path=["a/one.jsonl", "b/two.jsonl"]).default_name() == "one"
    assert FileSource(path="pairs.jsonl.gz").default_name() == "pairs"  # one file: as before


def test_parquet_shards_by_recursive_glob_in_path_order(write_config, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = _rows()
    for k in range(SHARDS):
        folder = tmp_path / "corpus" / f"day-{k // 5}"
        folder.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows[k * ROWS : (k + 1) * ROWS]), folder / f"part-{k:02d}.parquet")
    data = _load(write_config, "corpus/**/*.parquet")
    assert data.dataset["positive"] == [r["positive"] for r in rows] and data.sources[0].files == SHARDS
    assert data.sources[0].name == "corpus"


def test_csv_shards_with_another_header_refused(write_config, tmp_path):
    (tmp_path / "csv").mkdir()
    for k in range(3):
        (tmp_path / "csv" / f"p{k}.csv").write_text(
            "anchor,positive\n" + "".join(f"q{k}{i},a{k}{i}\n" for i in range(4))
        )
    (tmp_path / "csv" / "p1.csv").write_text("anchor,answer\nq,a\n")
    with pytest.raises(
        UserError, match=r"p1\.csv: columns anchor, answer differ from .*p0\.csv's \(anchor, positive\)"
    ):
        _load(write_config, "csv")
    (tmp_path / "csv" / "p1.csv").write_text("anchor,positive\nq,a\n")
    assert len(_load(write_config, "csv").dataset) == 9


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".json", ".csv", ".parquet"])
@pytest.mark.parametrize(("shard", "row", "where"), [(2, 0, "first"), (1, ROWS - 1, "last")])
def test_a_bad_cell_at_a_shard_boundary_is_named_in_its_own_shard(write_config, tmp_path, suffix, shard, row, where):
    """Issue 32 item 5b: row 0 of shard k > 0 is in shard k (not k-1's end), the last row of shard k in k;
    also for a .json shard holding JSON Lines (datasets reads it line by line), once named by its global row."""
    rows = _rows(3 * ROWS)
    rows[shard * ROWS + row]["anchor"] = None if suffix != ".csv" else ""
    folder = tmp_path / "shards"
    folder.mkdir()
    for k in range(3):
        chunk = rows[k * ROWS : (k + 1) * ROWS]
        path = folder / f"shard-{k:02d}{suffix}"
        if suffix == ".csv":
            path.write_text("anchor,positive\n" + "".join(f'"{r["anchor"]}",{r["positive"]}\n' for r in chunk))
        elif suffix == ".parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(chunk), path)
        else:
            _write_jsonl(path, chunk)  # .json: JSON Lines too
    with pytest.raises(UserError) as err:
        _load(write_config, "shards")
    message = str(err.value)
    # JSON Lines: line = row + 1; CSV: the header is line 1; Parquet and .json: row N (1-based).
    locator = {".csv": f"line {row + 2}", ".parquet": f"row {row + 1}", ".json": f"row {row + 1}"}
    locator = locator.get(suffix, f"line {row + 1}")
    assert f"shard-{shard:02d}{suffix}: {locator}:" in message, (where, message)
    assert "empty" in message and "\n" not in message, message
