"""``validate`` and ``inspect-data`` judge duplicates as the training sampler does (issue 23 item 14):
texts an uncased tokenizer makes one are one text when training pre-tokenizes, so ``validate``
refuses what ``train`` would refuse, and both name the column."""

from __future__ import annotations

import re

from typer.testing import CliRunner

from cembed.cli.app import app

# 12 anchors, all different as raw text, 3 different as an uncased tokenizer's ids.
BASES = ["what is a cat", "what is a dog", "what is a cow"]
ANCHORS = [v for b in BASES for v in (b, b.upper(), b.title(), b.capitalize())]


def _config(write_config, pairs_file, model_dir, tmp_path, pretokenize=True):
    rows = [{"anchor": a, "positive": f"answer {i}"} for i, a in enumerate(ANCHORS)]
    return write_config(
        {
            "model": {"name_or_path": str(model_dir), "device": "cpu"},
            "data": {"train": str(pairs_file(rows)), "pretokenize": pretokenize},
            "batch": {"per_device_train_batch_size": 4, "mini_batch_size": 2},
            "train": {"output_dir": str(tmp_path / "out")},
        }
    )


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_validate_refuses_what_train_refuses_naming_the_column(
    tiny_model_dir, write_config, pairs_file, tmp_path, monkeypatch
):
    monkeypatch.setenv("CEMBED_CACHE_DIR", str(tmp_path / "cache"))
    path = _config(write_config, pairs_file, tiny_model_dir, tmp_path)
    runner = CliRunner()
    r = runner.invoke(app, ["validate", str(path)], terminal_width=400)
    assert r.exit_code == 2, r.output
    assert (
        "the no-duplicates sampler cannot fill a single batch of 4 rows: column 'anchor' (role anchor) has only 3 "
        "distinct texts (compared as token ids (" in _flat(r.output)
    ), r.output
    r = runner.invoke(app, ["inspect-data", str(path)], terminal_width=400)
    assert r.exit_code == 0, r.output
    assert re.search(r"distinct texts: anchor \(anchor\)\s*│ 3 ", r.output) and "token ids" in r.output, r.output
    r = runner.invoke(app, ["train", str(path)], terminal_width=400)
    assert r.exit_code == 2, r.output
    assert (
        "cannot fill a single batch of 4 rows: column 'anchor' has only 3 distinct texts (compared as token ids, "
        "as the model sees them)" in _flat(r.output)
    ), r.output


def test_without_pretokenize_the_sampler_compares_raw_text(
    tiny_model_dir, write_config, pairs_file, tmp_path, monkeypatch
):
    # data.pretokenize false: sentence-transformers tokenizes in the collator and the sampler sees
    # the raw texts (12 distinct anchors), so validate passes and inspect-data says raw text.
    monkeypatch.setenv("CEMBED_CACHE_DIR", str(tmp_path / "cache"))
    path = _config(write_config, pairs_file, tiny_model_dir, tmp_path, pretokenize=False)
    r = CliRunner().invoke(app, ["validate", str(path)], terminal_width=400)
    assert r.exit_code == 0 and "config OK" in r.output, r.output
    r = CliRunner().invoke(app, ["inspect-data", str(path)], terminal_width=400)
    assert r.exit_code == 0 and "raw text, as the sampler compares" in r.output, r.output
    assert "them (data.pretokenize is false)" in r.output, r.output
