"""Issue 32 item 11: ``validate`` shows the prompts each source trains with (text and ``--json``), and a
prompt that leaves no room for the text at ``max_seq_length`` is named as the cause of the refusal."""

from __future__ import annotations

import json

import pytest
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
    assert (
        "prompts of source a: anchor 'query: ' (data.train.a.prompts.anchor); positive 'doc: ' (data.prompts.positive)"
        in text
    ), text
    assert "prompts of source b: positive 'doc: ' (data.prompts.positive)" in text, text
    report = json.loads(CliRunner().invoke(app, ["validate", str(cfg), "--json"]).output)
    shown = {s["name"]: {r: v["prompt"] for r, v in s["prompts"].items()} for s in report["data"]["sources"]}
    assert shown == {
        "a": {"anchor": "query: ", "positive": "doc: ", "negatives": "doc: "},
        "b": {"anchor": "", "positive": "doc: ", "negatives": "doc: "},
    }


LONG_PROMPT = "one two three four five six seven eight nine ten eleven twelve: "


@pytest.mark.parametrize("command", ["validate", "train"])
@pytest.mark.parametrize("own", [False, True])
def test_a_prompt_leaving_no_room_for_the_text_is_named_as_the_cause(
    write_config, pairs_file, tiny_model_dir, tmp_path, command, own
):
    """Issue 32 item 11b: at max_seq_length 12 the anchor prompt (its tokens and the model's [CLS]
    and [SEP]) leaves no token of any anchor, so every anchor is the prompt alone and the sampler
    cannot fill a batch: the refusal names the prompt, its field, the role, the source and the lengths."""
    from sentence_transformers import SentenceTransformer

    data = pairs_file(distinct_pairs(32))
    if own:
        cfg = _config(
            write_config, pairs_file, tiny_model_dir, tmp_path, {"path": str(data), "prompts": {"anchor": LONG_PROMPT}}
        )
    else:
        cfg = _config(write_config, pairs_file, tiny_model_dir, tmp_path, str(data), prompts={"anchor": LONG_PROMPT})
    tokens = len(SentenceTransformer(str(tiny_model_dir), device="cpu").tokenizer(LONG_PROMPT)["input_ids"])
    assert tokens >= 12  # [CLS] prompt [SEP]: no room left at 12
    r = CliRunner().invoke(app, [command, str(cfg), "model.max_seq_length=12"])
    assert r.exit_code == 2, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in r.output, r.output
    line = errors[0]
    field = "data.train.prompts.anchor" if own else "data.prompts.anchor"
    assert f"{field} {LONG_PROMPT!r}" in line, line
    assert f"{tokens} tokens with the model's special tokens, max_seq_length 12" in line, line
    assert "no token of the anchor texts" in line and str(data) in line, line
    assert "shorten the prompt or raise model.max_seq_length" in line, line
