"""Data checks: bad cells, missing columns and impossible batches are refused before training."""

from __future__ import annotations

import json

import pytest
from conftest import distinct_pairs
from typer.testing import CliRunner

from cembed.cli.app import app
from cembed.config.file import load_config
from cembed.config.sources import SOURCE_CONFIGS, FileSource, HubSource
from cembed.data.sources.registry import LOADERS
from cembed.errors import UserError
from cembed.train.recipe import check_run_inputs


def _cfg(write_config, train, bs=4, **extra):
    cfg = {
        "data": {"train": str(train), **extra.pop("data", {})},
        "batch": {"per_device_train_batch_size": bs, "mini_batch_size": 2},
    }
    cfg.update(extra)
    return load_config(write_config(cfg))


@pytest.mark.parametrize(
    "bad, kind",
    [(None, "empty \\(null/NaN\\)"), ("", "empty or whitespace-only"), ("   \t", "empty or whitespace-only")],
)
def test_bad_cell_names_column_and_row(write_config, pairs_file, bad, kind):
    rows = distinct_pairs(10)
    rows[6]["positive"] = bad
    cfg = _cfg(write_config, pairs_file(rows))
    with pytest.raises(UserError, match=rf"line 7: column 'positive' \(role positive\) is {kind}; .*drop_invalid_rows"):
        check_run_inputs(cfg)


def test_drop_invalid_rows_counts_them(write_config, pairs_file):
    rows = distinct_pairs(10)
    rows[2]["anchor"] = None
    rows[5]["positive"] = " "
    cfg = _cfg(write_config, pairs_file(rows), data={"drop_invalid_rows": True})
    _, data = check_run_inputs(cfg)
    assert data.rows_dropped == 2 and len(data.dataset) == 8
    assert "question number 2" not in data.dataset["anchor"]


def test_non_text_column_refused(write_config, pairs_file):
    rows = [{"anchor": i, "positive": f"p{i}"} for i in range(10)]
    with pytest.raises(UserError, match=r"column 'anchor' \(role anchor\) holds int64 values; it must hold text"):
        check_run_inputs(_cfg(write_config, pairs_file(rows)))


def test_missing_column_lists_existing(write_config, pairs_file):
    rows = [{"question": f"q{i}", "answer": f"a{i}", "id": i} for i in range(10)]
    with pytest.raises(
        UserError,
        match=r"column 'anchor' \(data.columns.anchor\) not found; the data has columns: question, answer, id",
    ):
        check_run_inputs(_cfg(write_config, pairs_file(rows)))


def test_column_mapping_drops_unnamed_columns_and_orders_roles(write_config, pairs_file):
    rows = [{"q": f"q{i}", "a": f"a{i}", "n": f"n{i}", "junk": "x"} for i in range(10)]
    cfg = _cfg(write_config, pairs_file(rows), data={"columns": {"anchor": "q", "positive": "a", "negatives": ["n"]}})
    _, data = check_run_inputs(cfg)
    assert data.columns == ["anchor", "positive", "negative_1"]
    assert data.dataset[3] == {"anchor": "q3", "positive": "a3", "negative_1": "n3"}


def test_missing_data_file(write_config, tmp_path):
    with pytest.raises(UserError, match=r"missing\.jsonl: data file not found"):
        check_run_inputs(_cfg(write_config, tmp_path / "missing.jsonl"))


def test_batch_larger_than_dataset(write_config, pairs_file):
    with pytest.raises(UserError, match=r"6 rows is fewer than one batch of 8"):
        check_run_inputs(_cfg(write_config, pairs_file(distinct_pairs(6)), bs=8))


def test_one_anchor_everywhere_is_refused(write_config, pairs_file):
    rows = [{"anchor": "the same question", "positive": f"answer {i}"} for i in range(20)]
    with pytest.raises(
        UserError, match=r"column 'anchor' \(role anchor\) has only 1 distinct texts, so no duplicate-free batch of 4"
    ):
        check_run_inputs(_cfg(write_config, pairs_file(rows)))


def test_tsv_and_csv_load(write_config, tmp_path):
    tsv = tmp_path / "pairs.tsv"
    tsv.write_text("anchor\tpositive\n" + "".join(f"q {i}\ta {i}\n" for i in range(8)))
    _, data = check_run_inputs(_cfg(write_config, tsv))
    assert data.dataset[7] == {"anchor": "q 7", "positive": "a 7"}


@pytest.mark.slow
def test_validate_cli_prints_lr_and_first_row(write_config, pairs_file):
    path = write_config(
        {
            "data": {"train": str(pairs_file(distinct_pairs(64)))},
            "batch": {"per_device_train_batch_size": 32, "mini_batch_size": 8},
        }
    )
    r = CliRunner().invoke(app, ["validate", str(path)])
    assert r.exit_code == 0, r.output
    assert "effective learning_rate: 2.000e-05 = 2e-05 x sqrt(32/32) (lr_scaling: sqrt)" in r.output
    assert "question number 0" in r.output and "config OK" in r.output


def test_cli_user_error_exit_code_2_no_traceback(write_config, pairs_file):
    rows = distinct_pairs(10)
    rows[3]["anchor"] = None
    path = write_config(
        {"data": {"train": str(pairs_file(rows))}, "batch": {"per_device_train_batch_size": 4, "mini_batch_size": 2}}
    )
    r = CliRunner().invoke(app, ["validate", str(path)])
    assert r.exit_code == 2
    assert "line 4: column 'anchor'" in r.output and "Traceback" not in r.output


def test_source_kind_inferred_from_path(write_config, pairs_file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path.parent)  # relative paths must resolve against the config, not the cwd
    pairs_file(distinct_pairs(4), name="x.jsonl")
    (tmp_path / "pairs_no_extension").write_text("")
    bs = {"per_device_train_batch_size": 4, "mini_batch_size": 2}
    file_cfg = load_config(write_config({"data": {"train": "x.jsonl"}, "batch": bs}))
    assert isinstance(file_cfg.data.train, FileSource) and file_cfg.data.train.path == str(tmp_path / "x.jsonl")
    bare = load_config(write_config({"data": {"train": "pairs_no_extension"}, "batch": bs}))
    assert isinstance(bare.data.train, FileSource) and bare.data.train.path == str(tmp_path / "pairs_no_extension")
    hub = load_config(write_config({"data": {"train": {"path": "org/name", "split": "train"}}, "batch": bs}))
    assert isinstance(hub.data.train, HubSource) and hub.data.train.path == "org/name"
    forced = load_config(write_config({"data": {"train": {"kind": "hub", "path": "pairs.jsonl"}}, "batch": bs}))
    assert isinstance(forced.data.train, HubSource) and forced.data.train.path == "pairs.jsonl"


def test_unknown_source_kind_names_field_line_and_kinds(write_config):
    path = write_config("data:\n  train:\n    kind: s3\n    path: bucket/pairs.jsonl\n")
    with pytest.raises(UserError) as e:
        load_config(path)
    msg = str(e.value)
    assert f"{path}:3: data.train.kind: unknown value 's3'" in msg
    assert "'file', 'hub'" in msg


def test_every_source_kind_has_a_loader():
    assert set(LOADERS) == set(SOURCE_CONFIGS)


def _mixed_file(tmp_path, lines: list[str]):
    p = tmp_path / "mixed.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


@pytest.mark.parametrize(
    "cell, described",
    [
        ("42", "a number (42)"),
        ('["x", "y"]', 'a list (["x","y"])'),
        ("true", "a boolean (true)"),
        ('{"a": 1}', "an object"),
    ],
)
def test_non_text_cell_in_jsonl_names_line_and_column(write_config, tmp_path, cell, described):
    lines = [json.dumps(r) for r in distinct_pairs(6)]
    lines[1] = f'{{"anchor": "a1", "positive": {cell}}}'
    cfg = _cfg(write_config, _mixed_file(tmp_path, lines))
    with pytest.raises(UserError) as err:
        check_run_inputs(cfg)
    assert f"line 2: column 'positive' (role positive) holds {described}" in str(err.value)
    assert "it must hold text" in str(err.value) and "extension" not in str(err.value)


def test_non_text_cell_after_a_blank_line_names_the_file_line(write_config, tmp_path):
    lines = [json.dumps(r) for r in distinct_pairs(6)]
    lines[2] = ""
    lines[4] = '{"anchor": "a4", "positive": 42}'
    cfg = _cfg(write_config, _mixed_file(tmp_path, lines))
    with pytest.raises(UserError, match=r"line 5: column 'positive' \(role positive\) holds a number \(42\)"):
        check_run_inputs(cfg)


def test_drop_invalid_rows_skips_non_text_cells(write_config, tmp_path):
    lines = [json.dumps(r) for r in distinct_pairs(10)]
    lines[1] = '{"anchor": "a1", "positive": 42}'
    lines[4] = '{"anchor": ["a", "b"], "positive": "p4"}'
    lines[6] = '{"anchor": "a6", "positive": NaN}'
    cfg = _cfg(write_config, _mixed_file(tmp_path, lines), data={"drop_invalid_rows": True})
    _, data = check_run_inputs(cfg)
    assert data.rows_dropped == 3 and len(data.dataset) == 7
    assert data.dataset.features["positive"].dtype == "string" and data.dataset.features["anchor"].dtype == "string"
    assert data.dataset["anchor"][:2] == ["question number 0", "question number 2"]
