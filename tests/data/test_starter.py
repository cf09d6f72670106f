"""``cembed init``: a starter config from a model and a data file."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from typer.testing import CliRunner

from cembed.cli.app import app
from cembed.data.starter import make_starter, propose_roles, suggest_batch_size
from cembed.errors import UserError


def test_propose_roles_by_name_and_position():
    roles, negs, how = propose_roles(["id", "question", "answer", "hard_negative_2", "hard_negative_1"])
    # "id" is not a text name, but propose_roles only ever sees text columns
    assert roles == {"anchor": "question", "positive": "answer"} and how["anchor"] == "by name"
    assert negs == ["hard_negative_2", "hard_negative_1"]
    roles, negs, _ = propose_roles(["sentence1", "sentence2"])
    assert roles == {"anchor": "sentence1", "positive": "sentence2"} and negs == []
    roles, negs, _ = propose_roles(["Query", "Passage", "negative"])
    assert roles == {"anchor": "Query", "positive": "Passage"} and negs == ["negative"]
    roles, _, how = propose_roles(["left", "right"])
    assert roles == {"anchor": "left", "positive": "right"} and how == {
        "anchor": "by position",
        "positive": "by position",
    }
    with pytest.raises(UserError, match="needs two text columns"):
        propose_roles(["only"])


def test_suggest_batch_size():
    assert suggest_batch_size(largest_batch=7047, rows=50071) == 4096
    assert suggest_batch_size(largest_batch=40, rows=40) == 8  # at least 4 steps per epoch
    assert suggest_batch_size(largest_batch=3, rows=1000) == 2  # duplicates limit it
    assert suggest_batch_size(largest_batch=10**7, rows=10**8) == 65536  # capped
    with pytest.raises(UserError, match="too few"):
        suggest_batch_size(largest_batch=1, rows=1000)


def _rows(n, dup_every=None):
    out = []
    for i in range(n):
        q = f"question {i % dup_every if dup_every else i}"
        out.append({"query": q, "document": f"doc {i}", "negative": f"neg {i}", "score": float(i)})
    return out


def test_init_writes_a_config_that_validates(tmp_path, tiny_model_dir):
    table = pa.Table.from_pylist(_rows(64, dup_every=20))  # 20 distinct queries: batches of at most 20
    data = tmp_path / "data" / "pairs.parquet"
    data.parent.mkdir()
    pq.write_table(table, data)
    out = tmp_path / "configs" / "mine.yaml"
    r = CliRunner().invoke(app, ["init", str(out), "--model", str(tiny_model_dir), "--data", str(data)])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "64 rows" in text and "per_device_train_batch_size: 16 (largest duplicate-free batch found: 20" in text
    cfg = yaml.safe_load(out.read_text())
    assert cfg["data"]["train"] == "../data/pairs.parquet"  # relative to the config file
    assert cfg["data"]["columns"] == {"anchor": "query", "positive": "document", "negatives": ["negative"]}
    assert cfg["batch"]["per_device_train_batch_size"] == 16 and cfg["model"]["name_or_path"] == str(tiny_model_dir)
    assert out.read_text().startswith("# Starter config written by `cembed init`")
    r = CliRunner().invoke(app, ["validate", str(out)])
    assert r.exit_code == 0 and "config OK" in r.output, r.output


def test_init_refuses_to_overwrite(tmp_path, pairs_file):
    from conftest import distinct_pairs

    out = tmp_path / "exists.yaml"
    out.write_text("keep me\n")
    r = CliRunner().invoke(app, ["init", str(out), "--data", str(pairs_file(distinct_pairs(16)))])
    assert r.exit_code == 2
    assert r.output.strip().count("\n") == 0 and "already exists; cembed init never overwrites" in r.output
    assert out.read_text() == "keep me\n"


@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".jsonl.gz"])
def test_init_reads_every_file_type(tmp_path, suffix):
    import gzip
    import json

    rows = [{"anchor": f"a {i}", "positive": f"p {i}"} for i in range(32)]
    path = tmp_path / f"pairs{suffix}"
    if suffix == ".jsonl.gz":
        path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    else:
        sep = "," if suffix == ".csv" else "\t"
        path.write_text("anchor" + sep + "positive\n" + "".join(f"{r['anchor']}{sep}{r['positive']}\n" for r in rows))
    starter = make_starter(tmp_path / "c.yaml", "all-MiniLM-L6-v2", path)
    assert (
        starter.rows == 32 and starter.batch_size == 8 and starter.roles == {"anchor": "anchor", "positive": "positive"}
    )
    assert not (tmp_path / "c.yaml").exists()  # make_starter only renders; write_starter writes


def test_init_counts_rows_with_empty_cells(tmp_path, pairs_file):
    from conftest import distinct_pairs

    rows = distinct_pairs(40)
    rows[5]["positive"] = ""
    starter = make_starter(tmp_path / "c.yaml", "m", pairs_file(rows))
    assert starter.rows == 40 and starter.rows_invalid == 1
    assert yaml.safe_load(starter.text)["data"]["drop_invalid_rows"] is True
