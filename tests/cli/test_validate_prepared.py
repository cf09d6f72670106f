"""``cembed validate`` / ``train`` on a prepared source (issue 24 item 4): rows and batches shown,
and each mistake refused with exit 2 and one line naming the field or the part."""

from __future__ import annotations

import json

import pytest
from prepared_helpers import pair_rows, write_prepared
from sentence_transformers import SentenceTransformer
from typer.testing import CliRunner

from cembed.cli.app import app

ROWS = pair_rows(120)


@pytest.fixture
def prepared_config(tmp_path, tiny_model_dir, write_config):
    tiny = SentenceTransformer(str(tiny_model_dir), device="cpu")
    write_prepared(tmp_path / "prepared", ROWS, tiny.tokenizer, tiny.max_seq_length)

    def _config(model_dir=tiny_model_dir, **source):
        return write_config(
            {
                "model": {"name_or_path": str(model_dir), "device": "cpu"},
                "data": {"train": {"prepared": "prepared", **source}},
                "batch": {"per_device_train_batch_size": 16, "mini_batch_size": 4},
                "train": {"output_dir": str(tmp_path / "run"), "max_steps": 2},
            }
        )

    return _config


def _one_line_error(r, exit_code=2) -> str:
    assert r.exit_code == exit_code, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]  # train prints its plan line first
    assert len(errors) == 1 and lines[-1] == errors[0] and "Traceback" not in r.output, r.output
    return errors[0]


def test_validate_shows_rows_batches_first_row_and_ids_at_the_length(prepared_config):
    r = CliRunner().invoke(app, ["validate", str(prepared_config())])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "prepared: 120 rows read, 0 dropped, 120 to train on; 7 batches of 16 per epoch" in text, r.output
    assert f"first row: anchor {ROWS[0]['anchor']!r} | positive {ROWS[0]['positive']!r}" in text, r.output
    # 12 positives of the 120 rows are longer than 64 tokens: their ids stop at 64.
    assert (
        "rows at max_seq_length: anchor 0 (0.0%; longest" in text and "positive 12 (10.0%; longest 64 tokens)" in text
    )
    report = json.loads(CliRunner().invoke(app, ["validate", str(prepared_config()), "--json"]).output)
    assert report["data"]["rows"] == 120 and report["data"]["batches_per_epoch"] == 7
    assert report["loss"]["columns"] == {"anchor": "anchor", "positive": "positive"}


@pytest.mark.parametrize("command", ["validate", "train"])
def test_another_max_seq_length_is_refused_naming_the_field(prepared_config, command):
    r = CliRunner().invoke(app, [command, str(prepared_config()), "model.max_seq_length=32"])
    line = _one_line_error(r)
    assert "max_seq_length: the model's is 32, the prepared source's 64" in line, line


def test_another_tokenizer_is_refused_naming_the_field(prepared_config, tmp_path):
    from conftest import make_tiny_model
    from transformers import AutoTokenizer

    other = make_tiny_model(tmp_path / "cased")
    # The same model with a tokenizer that keeps case: another tokenizer fingerprint.
    AutoTokenizer.from_pretrained(str(other), do_lower_case=False).save_pretrained(str(other))
    r = CliRunner().invoke(app, ["validate", str(prepared_config(model_dir=other))])
    assert "tokenizer: the model's fingerprint is" in _one_line_error(r)


@pytest.mark.parametrize("damage", ["missing", "resized"])
def test_a_missing_or_resized_part_is_refused_naming_it(prepared_config, tmp_path, damage):
    part = tmp_path / "prepared" / "part-00001.arrow"
    if damage == "missing":
        part.unlink()
    else:
        part.write_bytes(part.read_bytes() + b"\0")
    line = _one_line_error(CliRunner().invoke(app, ["validate", str(prepared_config())]))
    assert "part part-00001.arrow" in line and ("missing" in line if damage == "missing" else "bytes" in line), line


def test_columns_on_a_prepared_source_is_refused_naming_the_field(prepared_config):
    line = _one_line_error(CliRunner().invoke(app, ["validate", str(prepared_config(columns={"anchor": "q"}))]))
    assert "data.train.columns: a prepared source's roles are its manifest's columns" in line, line


@pytest.fixture
def prompted_config(tmp_path, tiny_model_dir, write_config, pairs_file):
    """A source prepared by ``cembed prepare-data`` with ``data.prompts.anchor: 'q: '``, and a config
    training from it (``**data``: the data section's other fields)."""
    text = write_config(
        {
            "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
            "data": {"train": str(pairs_file(ROWS)), "prompts": {"anchor": "q: "}},
            "batch": {"per_device_train_batch_size": 16, "mini_batch_size": 4},
        },
        name="prepare.yaml",
    )
    r = CliRunner().invoke(app, ["prepare-data", str(text), "-o", str(tmp_path / "prompted")])
    assert r.exit_code == 0, r.output

    def _config(train=None, **data):
        return write_config(
            {
                "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
                "data": {"train": train or {"prepared": "prompted"}, **data},
                "batch": {"per_device_train_batch_size": 16, "mini_batch_size": 4},
                "train": {"output_dir": str(tmp_path / "run"), "max_steps": 1},
            }
        )

    return _config


@pytest.mark.parametrize("command", ["validate", "train", "estimate"])
def test_a_source_prepared_with_prompts_trained_without_them_is_refused(prompted_config, command):
    """Issue 32 item 5d: the manifest's prompt is compared with the run's in this direction too, in one
    line naming the field to set."""
    extra = ["--gpu", "A100"] if command == "estimate" else []
    line = _one_line_error(CliRunner().invoke(app, [command, str(prompted_config()), *extra]))
    assert "prompts.anchor: the run's is '', the prepared source's 'q: '" in line, line
    assert "data.prompts.anchor" in line, line
    # The source's own prompt, another one: the field named is the source's.
    cfg = prompted_config(train={"prepared": "prompted", "prompts": {"anchor": "other: "}})
    line = _one_line_error(CliRunner().invoke(app, [command, str(cfg), *extra]))
    assert "prompts.anchor: the run's is 'other: ', the prepared source's 'q: '" in line, line
    assert "set data.train.prompts.anchor to the source's" in line, line


@pytest.mark.parametrize("command", ["validate", "estimate", "train"])
@pytest.mark.parametrize("where", ["data.prompts", "the source's prompts"])
def test_a_source_prepared_with_prompts_trains_with_the_same_prompts(prompted_config, command, where):
    """The same prompt, run-wide or the source's own (``data.train.prompts``), is accepted."""
    if where == "data.prompts":
        cfg = prompted_config(prompts={"anchor": "q: "})
    else:
        cfg = prompted_config(train={"prepared": "prompted", "prompts": {"anchor": "q: "}})
    extra = ["--gpu", "A100"] if command == "estimate" else []
    r = CliRunner().invoke(app, [command, str(cfg), *extra])
    assert r.exit_code == 0, r.output
