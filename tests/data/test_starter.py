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
    # 20 questions asked about 3 times each: at 16 or 8 the sampler leaves over 5 % of the rows unused, at 4 none
    assert "64 rows" in text and "per_device_train_batch_size: 4 (16 batches per epoch, 0 of 64 rows unused;" in text
    assert "largest duplicate-free batch found: 20;" in text, text
    cfg = yaml.safe_load(out.read_text())
    assert cfg["data"]["train"] == "../data/pairs.parquet"  # relative to the config file
    assert cfg["data"]["columns"] == {"anchor": "query", "positive": "document", "negatives": ["negative"]}
    assert cfg["batch"]["per_device_train_batch_size"] == 4 and cfg["model"]["name_or_path"] == str(tiny_model_dir)
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


def _starter_unused(starter, model_dir):
    """Rows the training sampler leaves unused at the starter's batch, as validate counts them."""
    from cembed.cli.common import load
    from cembed.data.batching.full_table import build_batches
    from cembed.data.batching.placement import sampler_hashes
    from cembed.data.load import load_training_data

    cfg = load(starter.out, [])
    data = load_training_data(cfg.data)
    hashes, compared, _ = sampler_hashes(data, cfg.model, cfg.data)
    assert compared.startswith("token ids")
    return build_batches(hashes, cfg.batch.per_device_train_batch_size, cfg.batch.drop_last, cfg.train.seed)[1]


def test_init_proposes_a_batch_the_sampler_fills(tmp_path, tiny_model_dir, pairs_file):
    # 400 rows, 100 distinct questions asked 4 times each: at batch 64 the sampler leaves 80 rows
    # unused (20 %; the case), at 32 only the 16 of the short last batch (4 %).
    rows = [{"query": f"question {i % 100}", "answer": f"answer {i}"} for i in range(400)]
    out = tmp_path / "c.yaml"
    r = CliRunner().invoke(
        app, ["init", str(out), "--model", str(tiny_model_dir), "--data", str(pairs_file(rows))], terminal_width=200
    )
    assert r.exit_code == 0, r.output
    cfg = yaml.safe_load(out.read_text())
    assert cfg["batch"]["per_device_train_batch_size"] == 32, out.read_text()
    assert "per_device_train_batch_size: 32 (12 batches per epoch, 16 of 400 rows unused;" in r.output
    starter = make_starter(tmp_path / "again.yaml", str(tiny_model_dir), pairs_file(rows))
    starter.out.write_text(starter.text)
    assert _starter_unused(starter, tiny_model_dir) == starter.unused == 16 < 0.05 * 400
    r = CliRunner().invoke(app, ["validate", str(out)])
    assert r.exit_code == 0 and "cannot be placed" not in r.output, r.output


def test_init_says_why_no_batch_leaves_few_rows_unused(tmp_path, tiny_model_dir, pairs_file):
    # 30 of 40 rows share one question: a batch holds it once, so every size leaves >= 20 rows unused.
    rows = [{"query": "same question" if i < 30 else f"question {i}", "answer": f"answer {i}"} for i in range(40)]
    starter = make_starter(tmp_path / "c.yaml", str(tiny_model_dir), pairs_file(rows))
    assert starter.why is not None and "no batch of 2 to 10 rows leaves under 5% of the 40 rows unused" in starter.why
    starter.out.write_text(starter.text)
    assert _starter_unused(starter, tiny_model_dir) == starter.unused >= 20
    assert f"# {starter.why}" in starter.text


@pytest.mark.parametrize("override", ["train.max_steps=3", "train.num_train_epochs=2", None])
def test_starter_takes_either_length_override(tmp_path, tiny_model_dir, override):
    import json

    from conftest import distinct_pairs

    from cembed.cli.common import load

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in distinct_pairs(64)))
    starter = make_starter(tmp_path / "c.yaml", str(tiny_model_dir), data)
    starter.out.write_text(starter.text)
    cfg = load(starter.out, [override] if override else [])  # both set at once would be refused
    assert (cfg.train.max_steps, cfg.train.num_train_epochs) == {
        "train.max_steps=3": (3, None),
        "train.num_train_epochs=2": (None, 2),
        None: (None, 1),
    }[override]
    # both written, commented: the one to uncomment is in the file
    assert "  # num_train_epochs: 1" in starter.text and f"  # max_steps: {starter.batches}  " in starter.text


def test_init_takes_a_source_config_of_a_kind_that_can_be_inited(tmp_path, pairs_file):
    from conftest import distinct_pairs

    from cembed.config.sources import FileSource, PreparedSource

    data = pairs_file(distinct_pairs(16))
    starter = make_starter(tmp_path / "c.yaml", "m", FileSource(path=str(data), name="qa"))
    assert starter.rows == 16 and starter.data == str(data)  # the source's label
    assert '  train: {"kind": "file", "name": "qa", "path": "pairs.jsonl"}' in starter.text
    # A prepared folder holds token ids, no text to propose columns from: its kind says so (can_init).
    with pytest.raises(
        UserError, match=r"^prep: cembed init cannot read a prepared source \(it proposes text columns\)$"
    ):
        make_starter(tmp_path / "d.yaml", "m", PreparedSource(path="prep"))
