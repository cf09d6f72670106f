"""Prepare with another engine, train from it (issue 24 item 4): a prepared folder written the way
an external engine would (tokenizer ids, Arrow stream parts, no hash columns, the manifest) trains
exactly as the same rows from a JSONL file: same batches, step losses and final weights."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO
from prepared_helpers import pair_rows, write_jsonl, write_prepared
from safetensors.torch import load_file
from sentence_transformers import SentenceTransformer

pytestmark = pytest.mark.slow  # trains through `cembed train` subprocesses (and 2 ranks)

ROWS = pair_rows(120)


def _config(write_config, tmp_path, model_dir, train, name, per_device=16, max_steps=6):
    return write_config(
        {
            "model": {"name_or_path": str(model_dir), "device": "cpu"},
            "data": {"train": train, "cache_dir": str(tmp_path / "cache")},
            "batch": {"per_device_train_batch_size": per_device, "mini_batch_size": 5},
            "optim": {"learning_rate": 1e-3, "base_batch_size": 16},
            "train": {"max_steps": max_steps, "logging_steps": 1, "output_dir": str(tmp_path / name), "seed": 3},
        },
        name=f"{name}.yaml",
    )


def _train(config, nproc=1):
    args = [sys.executable, "-m", "cembed", "train", str(config)] + (
        ["--nproc-per-node", str(nproc)] if nproc > 1 else []
    )
    r = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def _summary(folder):
    return json.loads((folder / "run_summary.json").read_text())


def _max_dw(a, b):
    x, y = (load_file(str(next(f.glob("model.safetensors")))) for f in (a, b))
    return max((x[k] - y[k]).abs().max().item() for k in x)


def _prepare(tmp_path, model_dir):
    tiny = SentenceTransformer(str(model_dir), device="cpu")
    write_prepared(tmp_path / "prepared", ROWS, tiny.tokenizer, tiny.max_seq_length, split=50)
    write_jsonl(tmp_path / "pairs.jsonl", ROWS)


def test_prepared_by_another_engine_trains_as_the_text_file(tiny_model_dir, write_config, tmp_path):
    _prepare(tmp_path, tiny_model_dir)
    text = _config(write_config, tmp_path, tiny_model_dir, "pairs.jsonl", "text")
    prepared = _config(write_config, tmp_path, tiny_model_dir, {"prepared": "prepared"}, "prepared")
    _train(text)
    _train(prepared)
    a, b = _summary(tmp_path / "text"), _summary(tmp_path / "prepared")
    assert b["tokenization"]["pretokenized"] and b["tokenization"]["prepared"]
    assert b["data"]["rows_trained"] == a["data"]["rows_trained"] == 120
    assert b["data"]["rows_unplaced_first_epoch"] == a["data"]["rows_unplaced_first_epoch"]
    assert [s for s, _ in b["step_losses"]] == list(range(1, 7))
    assert b["step_losses"] == a["step_losses"]
    max_dw = _max_dw(tmp_path / "text", tmp_path / "prepared")
    print(f"prepared vs JSONL: max |dW| = {max_dw:.3e}")
    assert max_dw <= 1e-6, max_dw
    # The model card describes the manifest's sample texts, not token ids.
    card = (tmp_path / "prepared" / "README.md").read_text()
    assert ROWS[0]["anchor"] in card and "_input_ids" not in card


def test_two_ranks_from_a_prepared_source_equal_one_process(tiny_model_dir, write_config, tmp_path):
    _prepare(tmp_path, tiny_model_dir)
    one = _config(write_config, tmp_path, tiny_model_dir, {"prepared": "prepared"}, "one", per_device=16, max_steps=4)
    two = _config(write_config, tmp_path, tiny_model_dir, {"prepared": "prepared"}, "two", per_device=8, max_steps=4)
    _train(one)
    _train(two, nproc=2)
    assert _summary(tmp_path / "two")["plan"]["world_size"] == 2
    max_dw = _max_dw(tmp_path / "one", tmp_path / "two")
    print(f"2 ranks vs 1 process from a prepared source: max |dW| = {max_dw:.3e}")
    assert max_dw <= 1e-5, max_dw


def test_every_rank_compares_the_prepared_fingerprint(tiny_model_dir, write_config, tmp_path):
    import cembed.train.recipe as T
    from cembed.config.file import load_config
    from cembed.train.trainer import CembedTrainer

    class FactsSeen(CembedTrainer):
        facts: dict = {}

        def collective_facts(self):
            type(self).facts = super().collective_facts()
            return type(self).facts

    _prepare(tmp_path, tiny_model_dir)
    cfg = load_config(_config(write_config, tmp_path, tiny_model_dir, {"prepared": "prepared"}, "facts", max_steps=1))
    plan, data = T.check_run_inputs(cfg)
    T.run_training(cfg, plan, data, trainer_cls=FactsSeen)
    # What require_same_on_all_ranks compares: ranks that read another folder (or a re-prepared one) differ here.
    assert FactsSeen.facts["prepared"] == data.manifest.fingerprint and len(data.manifest.fingerprint) == 16


def test_prepared_by_prepare_data_in_two_parts_trains_as_the_text_file(tiny_model_dir, write_config, tmp_path):
    # cembed's own writer, as two nodes would run it (--part 0/2, --part 1/2 into one folder), then
    # training from the folder: the same step losses and weights as from the JSONL file itself.
    write_jsonl(tmp_path / "pairs.jsonl", ROWS)
    text = _config(write_config, tmp_path, tiny_model_dir, "pairs.jsonl", "text")
    for part in ("0/2", "1/2"):
        args = [sys.executable, "-m", "cembed", "prepare-data", str(text), "--output", str(tmp_path / "prep")]
        r = subprocess.run([*args, "--part", part], cwd=REPO, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
    manifest = json.loads((tmp_path / "prep" / "cembed_prepared.json").read_text())
    assert manifest["rows"] == 120 and len(manifest["parts"]) == 2
    prepared = _config(write_config, tmp_path, tiny_model_dir, {"prepared": "prep"}, "prepared")
    _train(text)
    _train(prepared)
    a, b = _summary(tmp_path / "text"), _summary(tmp_path / "prepared")
    assert b["tokenization"]["prepared"] and b["step_losses"] == a["step_losses"]
    assert _max_dw(tmp_path / "text", tmp_path / "prepared") <= 1e-6
