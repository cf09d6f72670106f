"""Issue 32 item 11: ``validate`` shows the prompts each source trains with (text and ``--json``), and a
prompt that leaves no room for the text at ``max_seq_length`` is named as the cause of the refusal."""

from __future__ import annotations

import json

from conftest import distinct_pairs
from typer.testing import CliRunner

from cembed.cli.app import app


def _config(write_config, pairs_file, tiny_model_dir, tmp_path, train, **data):
    return write_config(
        {
            "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
            "data": {"train": train, "cache_dir": str(tmp_path / "cache"), **data},
            "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
            "train": {"output_dir": str(tmp_path / "run"), "max_steps": 1},
        }
    )


def test_a_single_sources_own_prompts_are_shown(write_config, pairs_file, tiny_model_dir, tmp_path):
    data = str(pairs_file(distinct_pairs(32)))
    cfg = _config(write_config, pairs_file, tiny_model_dir, tmp_path, {"path": data, "prompts": {"anchor": "q: "}})
    r = CliRunner().invoke(app, ["validate", str(cfg)])
    assert r.exit_code == 0, r.output
    assert "prompts: none" not in r.output, r.output
    assert "prompts: anchor 'q: ' (data.train.prompts.anchor)" in r.output, r.output
    report = json.loads(CliRunner().invoke(app, ["validate", str(cfg), "--json"]).output)
    (source,) = report["data"]["sources"]
    assert source["prompts"]["anchor"] == {"prompt": "q: ", "from": "data.train.prompts.anchor"}
    assert source["prompts"]["positive"]["prompt"] == ""


def test_each_sources_prompts_are_shown(write_config, pairs_file, tiny_model_dir, tmp_path):
    a = str(pairs_file(distinct_pairs(32), name="a.jsonl"))
    b = str(
        pairs_file([{"anchor": f"other question {i}", "positive": f"other {i}"} for i in range(32)], name="b.jsonl")
    )
    train = {"a": {"path": a, "prompts": {"anchor": "query: "}}, "b": {"path": b}}
    cfg = _config(write_config, pairs_file, tiny_model_dir, tmp_path, train, prompts={"positive": "doc: "})
    r = CliRunner().invoke(app, ["validate", str(cfg)])
    assert r.exit_code == 0, r.output
    text = r.output
    assert "prompts: none" not in text, text
    assert "prompts of source a: anchor 'query: ' (data.train.a.prompts.anchor); positive 'doc: '" in text, text
    assert "prompts of source b: positive 'doc: ' (data.prompts.positive)" in text, text
    report = json.loads(CliRunner().invoke(app, ["validate", str(cfg), "--json"]).output)
    shown = {s["name"]: {r: v["prompt"] for r, v in s["prompts"].items()} for s in report["data"]["sources"]}
    assert shown == {
        "a": {"anchor": "query: ", "positive": "doc: ", "negatives": "doc: "},
        "b": {"anchor": "", "positive": "doc: ", "negatives": "doc: "},
    }
