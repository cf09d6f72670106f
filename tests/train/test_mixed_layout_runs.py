"""Sources with different column layouts in one run (issue 23 item 10): triplets (anchor, positive,
negative) beside pairs (question, answer). Every batch is one source and carries only its columns;
the loss embeds however many come; a killed + resumed run equals an uninterrupted one."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import KILL_AT_STEP_3, REPO
from safetensors.torch import load_file

import cembed.train.recipe as T
from cembed.config.file import config_from_dict
from cembed.train.trainer import CembedTrainer

PAIRS = [{"question": f"question {i} about a red car", "answer": f"answer {i} on the street"} for i in range(48)]
TRIPLETS = [
    {"anchor": f"a dog {i} in the park", "positive": f"a puppy {i} on grass", "negative": f"a cat {i} indoors"}
    for i in range(40)
]


def _write_sources(tmp_path):
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PAIRS))
    (tmp_path / "triplets.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TRIPLETS))
    return {
        "pairs": {"path": str(tmp_path / "pairs.jsonl"), "columns": {"anchor": "question", "positive": "answer"}},
        "triplets": {"path": str(tmp_path / "triplets.jsonl"), "columns": {"negatives": ["negative"]}},
    }


def _cfg(model_dir, tmp_path, out, pretokenize=True, max_steps=6, **data):
    return {
        "model": {"name_or_path": str(model_dir), "device": "cpu"},
        "data": {
            "train": _write_sources(tmp_path),
            "pretokenize": pretokenize,
            "cache_dir": str(tmp_path / "cache"),
            **data,
        },
        "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 3},
        "optim": {"learning_rate": 1e-3, "base_batch_size": 8},
        "train": {"max_steps": max_steps, "logging_steps": 1, "output_dir": str(out), "seed": 5},
    }


class ColumnsSeen(CembedTrainer):
    """Records the number of columns (features) each training batch hands the loss."""

    seen: list[int] = []

    def compute_loss(self, model, inputs, *args, **kwargs):
        features, _ = self.collect_features({k: v for k, v in inputs.items() if k != "dataset_name"})
        type(self).seen.append(len(features))
        return super().compute_loss(model, inputs, *args, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("pretokenize", [True, False])
def test_triplets_and_pairs_train_in_one_run_each_batch_with_its_columns(tiny_model_dir, tmp_path, pretokenize):
    cfg = config_from_dict(_cfg(tiny_model_dir, tmp_path, tmp_path / "out", pretokenize, max_steps=11), base=tmp_path)
    plan, data = T.check_run_inputs(cfg)
    assert data.columns == ["anchor", "positive", "negative_1"]
    ColumnsSeen.seen = []
    summary = T.run_training(cfg, plan, data, trainer_cls=ColumnsSeen)
    assert summary["status"] == "completed" and summary["tokenization"]["pretokenized"] is pretokenize
    from cembed.data.batching.mixture import SourceMix

    # The epoch's schedule (proportional: 6 pair batches, 5 triplet batches), as the sampler built it.
    mix = SourceMix.from_data(data, cfg.data.sampling)
    order = mix.schedule([len(PAIRS) // 8, len(TRIPLETS) // 8])
    assert ColumnsSeen.seen == [(2, 3)[i] for i in order] and {2, 3} <= set(ColumnsSeen.seen)
    assert [s["batches_trained"] for s in summary["data"]["sources"]] == [6, 5]
    assert [step for step, _ in summary["step_losses"]] == list(range(1, 12))  # no step skipped


def test_probe_and_workers_take_the_widest_layout(tiny_model_dir, tmp_path):
    cfg = config_from_dict(_cfg(tiny_model_dir, tmp_path, tmp_path / "out"), base=tmp_path)
    assert cfg.data.max_columns() == 3  # the pairs source is listed first
    plan, data = T.check_run_inputs(cfg)
    assert len(data.columns) == 3  # what resolve_runtime hands the probe as its worst case


def _weights(folder):
    return load_file(str(next(folder.glob("model.safetensors"))))


@pytest.mark.slow
def test_mixed_layouts_killed_and_resumed_equals_uninterrupted(tiny_dropout_model_dir, write_config, tmp_path):
    env_run = dict(cwd=REPO, capture_output=True, text=True, timeout=600)
    configs = {}
    for name in ("straight", "killed"):
        configs[name] = write_config(
            _cfg(tiny_dropout_model_dir, tmp_path, tmp_path / name, max_steps=7), name=f"{name}.yaml"
        )
    r = subprocess.run([sys.executable, "-m", "cembed", "train", str(configs["straight"])], **env_run)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-c", KILL_AT_STEP_3, str(configs["killed"])], **env_run)
    assert r.returncode == 143, r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "cembed", "train", str(configs["killed"]), "--resume"], **env_run)
    assert r.returncode == 0, r.stderr
    straight = json.loads((tmp_path / "straight" / "run_summary.json").read_text())
    resumed = json.loads((tmp_path / "killed" / "run_summary.json").read_text())
    assert resumed["resumed_from"].endswith("checkpoint-3")
    # Steps 4..7 after the resume: the same sources' batches and the same losses as uninterrupted.
    assert [s["batches_trained"] for s in resumed["data"]["sources"]] == [
        s["batches_trained"] for s in straight["data"]["sources"]
    ]
    losses = dict(map(tuple, straight["step_losses"]))
    after = dict(map(tuple, resumed["step_losses"]))  # 1..3 from checkpoint-3, 4..7 trained after the resume
    assert sorted(after) == list(range(1, 8))
    for step in after:
        assert after[step] == pytest.approx(losses[step], abs=1e-6), step
    a, b = _weights(tmp_path / "straight"), _weights(tmp_path / "killed")
    max_dw = max((a[k] - b[k]).abs().max().item() for k in a)
    assert max_dw <= 1e-6, max_dw


@pytest.mark.slow
def test_two_ranks_on_mixed_layouts_equal_one_process(tiny_model_dir, write_config, tmp_path):
    """2 gloo processes x 4 rows (embeddings gathered across ranks) train the same steps as one process
    x 8 rows: at every step both ranks hold the same source's rows and embed the same columns, so the
    gather lines up; step losses and final weights agree."""
    env_run = dict(cwd=REPO, capture_output=True, text=True, timeout=600)
    runs = {}
    for name, per_device, nproc in (("one", 8, 1), ("two", 4, 2)):
        cfg = _cfg(tiny_model_dir, tmp_path, tmp_path / name, max_steps=6)
        cfg["batch"] = {"per_device_train_batch_size": per_device, "mini_batch_size": 3}
        path = write_config(cfg, name=f"{name}.yaml")
        r = subprocess.run(
            [sys.executable, "-m", "cembed", "train", str(path), "--nproc-per-node", str(nproc)], **env_run
        )
        assert r.returncode == 0, r.stdout + r.stderr
        runs[name] = json.loads((tmp_path / name / "run_summary.json").read_text())
    assert runs["two"]["plan"]["world_size"] == 2 and runs["two"]["distributed"]["gather_across_devices"]
    assert [s["batches_trained"] for s in runs["two"]["data"]["sources"]] == [
        s["batches_trained"] for s in runs["one"]["data"]["sources"]
    ]
    assert all(s["batches_trained"] > 0 for s in runs["two"]["data"]["sources"])  # both layouts trained
    # (step losses are each process's own anchors', so only their mean over ranks would match)
    a, b = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    max_dw = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"2 ranks vs 1 process on mixed layouts: max |dW| = {max_dw:.3e}")
    assert max_dw <= 1e-5, max_dw


@pytest.mark.slow
def test_two_epochs_of_two_sources_record_batches_per_epoch_and_warn_of_unused_rows(
    tiny_model_dir, write_config, tmp_path
):
    """Issue 32 item 10: after 2 epochs run_summary.json still records each source's batches per
    epoch, and round_robin over 37 and 8 rows (batches of 4: 9 and 2) says in validate and at the
    start of train that it leaves 29 of the 37 rows unused each epoch."""
    import re

    from typer.testing import CliRunner

    from cembed.cli.app import app

    rows = [{"anchor": f"question {i} about a red car", "positive": f"answer {i} on the street"} for i in range(45)]
    for name, part in (("big", rows[:37]), ("small", rows[37:])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    cfg = {
        "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
        "data": {
            "train": {"big": str(tmp_path / "big.jsonl"), "small": str(tmp_path / "small.jsonl")},
            "sampling": {"strategy": "round_robin"},
            "cache_dir": str(tmp_path / "cache"),
        },
        "batch": {"per_device_train_batch_size": 4, "mini_batch_size": 2},
        "train": {"num_train_epochs": 2, "logging_steps": 1, "output_dir": str(tmp_path / "out"), "seed": 5},
    }
    path = write_config(cfg)
    unused = re.compile(r"data\.train\.big \([^)]*big\.jsonl\): 29 of 37 rows \(78%\) unused each epoch under\s+data\.sampling\.strategy round_robin")  # fmt: skip
    runner = CliRunner()
    r = runner.invoke(app, ["validate", str(path)], terminal_width=400)
    assert r.exit_code == 0 and unused.search(" ".join(r.output.split())), r.output
    r = runner.invoke(app, ["train", str(path)], terminal_width=400)
    assert r.exit_code == 0, r.output
    assert unused.search(" ".join(r.output.split())), r.output
    summary = json.loads((tmp_path / "out" / "run_summary.json").read_text())
    assert summary["steps"] == 8  # 2 rounds of (big, small) per epoch, 2 epochs
    sources = summary["data"]["sources"]
    assert [s["batches_per_epoch"] for s in sources] == [2, 2]
    assert [(s["batches_trained"], s["rows_trained"]) for s in sources] == [(4, 16), (4, 16)]
    assert any(unused.search(w) for w in summary["plan"]["warnings"])
