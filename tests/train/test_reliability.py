"""Reliability: resume equals uninterrupted, signals save work, NaN stops cleanly, bad input never
crashes, finished models are not overwritten."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import stat
import subprocess
import sys

import pytest
from conftest import KILL_AT_STEP_3, REPO, distinct_pairs
from safetensors.torch import load_file
from typer.testing import CliRunner

from cembed.cli.app import app
from cembed.config.file import load_config
from cembed.errors import RunFailed, UserError
from cembed.train.checkpoint import MARKER, latest_complete, remove_incomplete, resolve_resume
from cembed.train.recipe import check_run_inputs, run_training

ROWS = [
    {"anchor": f"question {i} about a {'red ' * (i % 5)}car", "positive": f"answer {i} on the street"}
    for i in range(96)
]


def _config(write_config, tmp_path, model_dir, out, **train):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return write_config(
        {
            "model": {"name_or_path": str(model_dir), "device": "cpu"},
            "data": {"train": str(data), "pretokenize": False},
            "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 3},
            "optim": {"learning_rate": 1e-3, "base_batch_size": 8},
            "train": {"max_steps": 6, "logging_steps": 1, "output_dir": str(out), "seed": 5, **train},
        },
        name=f"{out.name}.yaml",
    )


def _weights(folder):
    return load_file(str(next(folder.glob("model.safetensors"))))


@pytest.mark.slow
def test_sigterm_then_resume_equals_uninterrupted(tiny_dropout_model_dir, write_config, tmp_path):
    env_run = dict(cwd=REPO, capture_output=True, text=True, timeout=600)
    straight = _config(write_config, tmp_path, tiny_dropout_model_dir, tmp_path / "straight")
    r = subprocess.run([sys.executable, "-m", "cembed", "train", str(straight)], **env_run)
    assert r.returncode == 0, r.stderr

    killed = _config(write_config, tmp_path, tiny_dropout_model_dir, tmp_path / "killed")
    r = subprocess.run([sys.executable, "-c", KILL_AT_STEP_3, str(killed)], **env_run)
    assert r.returncode == 143, r.stdout + r.stderr  # 128 + SIGTERM
    assert "interrupted by SIGTERM at step 3" in r.stderr and "--resume" in r.stderr
    ckpt = tmp_path / "killed" / "checkpoint-3"
    assert (ckpt / MARKER).exists()
    assert json.loads((tmp_path / "killed" / "run_summary.json").read_text())["status"] == "interrupted"
    assert not (tmp_path / "killed" / "model.safetensors").exists()  # no final model for unfinished work

    r = subprocess.run([sys.executable, "-m", "cembed", "train", str(killed), "--resume"], **env_run)
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "killed" / "run_summary.json").read_text())
    assert (
        summary["status"] == "completed" and summary["steps"] == 6 and summary["resumed_from"].endswith("checkpoint-3")
    )
    a, b = _weights(tmp_path / "straight"), _weights(tmp_path / "killed")
    max_dw = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"resume vs uninterrupted: max |dW| = {max_dw:.3e} over {len(a)} tensors")
    assert max_dw <= 1e-6, max_dw
    # Dropout is on: a different seed would give different weights, so the equality is not vacuous.
    assert "train.log" in {p.name for p in (tmp_path / "killed").iterdir()}
    assert "interrupted by SIGTERM at step 3" in (tmp_path / "killed" / "train.log").read_text()


def test_checkpoint_without_marker_is_ignored(tmp_path):
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / MARKER).write_text("{}")
    (tmp_path / "checkpoint-4").mkdir()  # killed while saving: no marker
    (tmp_path / "checkpoint-4" / "model.safetensors").write_bytes(b"half")
    assert latest_complete(tmp_path) == tmp_path / "checkpoint-2"
    assert resolve_resume(tmp_path, resume=True, resume_from=None) == str(tmp_path / "checkpoint-2")
    with pytest.raises(UserError, match="not a complete cembed checkpoint"):
        resolve_resume(tmp_path, resume=False, resume_from=str(tmp_path / "checkpoint-4"))
    assert remove_incomplete(tmp_path) == [tmp_path / "checkpoint-4"]
    assert not (tmp_path / "checkpoint-4").exists() and (tmp_path / "checkpoint-2").exists()
    with pytest.raises(UserError, match="no complete checkpoint"):
        resolve_resume(tmp_path / "empty", resume=True, resume_from=None)


def _nan_at_call(n):
    import cembed.train.recipe as T

    real = T.build_loss

    def build(*args, **kwargs):
        built = real(*args, **kwargs)
        forward = built.module.forward
        calls = {"n": 0}

        def patched(features, labels):
            calls["n"] += 1
            value = forward(features, labels)
            return value * float("nan") if calls["n"] == n else value

        built.module.forward = patched
        return built

    return build


@pytest.mark.slow
def test_nan_loss_stops_naming_step_and_checkpoint(tiny_model_dir, write_config, tmp_path, monkeypatch):
    monkeypatch.setattr("cembed.train.recipe.build_loss", _nan_at_call(2))
    cfg = load_config(_config(write_config, tmp_path, tiny_model_dir, tmp_path / "nan", save_steps=1))
    plan, data = check_run_inputs(cfg)
    with pytest.raises(RunFailed, match=r"loss is nan at step 2; .*Last good checkpoint: .*checkpoint-1") as err:
        run_training(cfg, plan, data)
    assert err.value.exit_code == 3
    summary = json.loads((tmp_path / "nan" / "run_summary.json").read_text())
    assert summary["status"] == "failed" and "step 2" in summary["error"]


@pytest.mark.slow
def test_nan_loss_skip_policy_counts(tiny_model_dir, write_config, tmp_path, monkeypatch):
    monkeypatch.setattr("cembed.train.recipe.build_loss", _nan_at_call(2))
    cfg = load_config(_config(write_config, tmp_path, tiny_model_dir, tmp_path / "skip", nonfinite_loss="skip"))
    plan, data = check_run_inputs(cfg)
    summary = run_training(cfg, plan, data)
    assert summary["status"] == "completed" and summary["steps"] == 6 and summary["nonfinite_steps_skipped"] == 1


def _fp16_scaler_trainer(record: dict):
    """A CembedTrainer on accelerate's fp16 path, run on CPU: torch's own GradScaler scales the loss
    for backward and steps the optimizer, and ``unscale_gradients`` (called by the gradient
    clipping) unscales, as accelerate does under ``mixed_precision="fp16"`` on CUDA. Records the
    weights and the scale after every step."""
    import torch
    from transformers import TrainerCallback

    from cembed.train.trainer import CembedTrainer

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            record["weights"][state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
            record["scale"][state.global_step] = record["scaler"].get_scale()

    class Fp16ScalerTrainer(CembedTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            acc = self.accelerator
            acc.scaler = record["scaler"] = torch.amp.GradScaler("cpu")

            def unscale_gradients(optimizer=None):
                for opt in acc._optimizers:
                    acc.scaler.unscale_(opt.optimizer)

            acc.unscale_gradients = unscale_gradients
            self.add_callback(Record())

    record.update(weights={}, scale={})
    return Fp16ScalerTrainer


@pytest.mark.slow
def test_skip_nonfinite_with_grad_scaler(tiny_model_dir, write_config, tmp_path, monkeypatch):
    """fp16 + ``nonfinite_loss: skip``: the skipped step is a no-op that the GradScaler accepts (it
    used to raise "No inf checks were recorded for this optimizer")."""
    monkeypatch.setattr("cembed.train.recipe.build_loss", _nan_at_call(2))
    cfg = load_config(_config(write_config, tmp_path, tiny_model_dir, tmp_path / "fp16skip", nonfinite_loss="skip"))
    plan, data = check_run_inputs(cfg)
    record: dict = {}
    summary = run_training(cfg, plan, data, trainer_cls=_fp16_scaler_trainer(record))
    assert summary["status"] == "completed" and summary["steps"] == 6 and summary["nonfinite_steps_skipped"] == 1
    w = record["weights"]
    assert all(w[2][k].equal(w[1][k]) for k in w[1])  # step 2 changed nothing
    assert any(not w[3][k].equal(w[2][k]) for k in w[2])  # step 3 trained again
    assert record["scale"][2] == record["scale"][1] / 2  # the scaler saw the inf gradients and backed off


@pytest.mark.slow
def test_finished_output_dir_not_overwritten(tiny_model_dir, write_config, tmp_path):
    path = _config(write_config, tmp_path, tiny_model_dir, tmp_path / "done", max_steps=1)
    cfg = load_config(path)
    plan, data = check_run_inputs(cfg)
    run_training(cfg, plan, data)
    before = (tmp_path / "done" / "model.safetensors").read_bytes()
    r = CliRunner().invoke(app, ["train", str(path)])
    assert r.exit_code == 2 and "holds a finished model; pass --overwrite" in r.output
    assert (tmp_path / "done" / "model.safetensors").read_bytes() == before
    summary = run_training(cfg, plan, data, overwrite=True)
    assert summary["status"] == "completed"


@pytest.mark.slow
def test_a_requeued_resume_of_a_completed_run_says_so_and_exits_0_rewriting_nothing(
    tiny_model_dir, write_config, tmp_path
):
    """A Slurm requeue runs the same `cembed train cfg --resume` again after the run finished (before:
    refused, exit 2, "already at train.max_steps=1 and its run finished"). A longer run is still refused."""
    import hashlib

    out = tmp_path / "requeued"
    path = _config(write_config, tmp_path, tiny_model_dir, out, max_steps=1, save_steps=1)
    first = CliRunner().invoke(app, ["train", str(path)])
    assert first.exit_code == 0, first.output

    def outputs() -> dict:
        return {
            f.relative_to(out).as_posix(): (f.stat().st_mtime_ns, hashlib.sha256(f.read_bytes()).hexdigest())
            for f in sorted(out.rglob("*"))
            if f.is_file()
        }

    before = outputs()
    assert {"model.safetensors", "run_summary.json", "train.log", "checkpoint-1/model.safetensors"} <= set(before)
    again = CliRunner().invoke(app, ["train", str(path), "--resume"])
    assert again.exit_code == 0, again.output
    assert again.output.strip().splitlines() == [
        f"run already complete: {out} holds its final model and run_summary.json (status completed); nothing to resume"
    ]
    assert outputs() == before  # every file, the weights, the summary and train.log included, untouched
    longer = CliRunner().invoke(app, ["train", str(path), "train.max_steps=2", "--resume"])
    assert longer.exit_code == 2 and "belongs to a run of 1 steps, but train.max_steps is 2" in longer.output
    # the same without a checkpoint (no train.save_steps): before, "--resume: no complete checkpoint"
    shutil.rmtree(out / "checkpoint-1")
    before = outputs()
    again = CliRunner().invoke(app, ["train", str(path), "--resume"])
    assert again.exit_code == 0 and "run already complete" in again.output, again.output
    assert outputs() == before


def test_a_run_that_replaces_a_completed_one_removes_its_summary(tmp_path):
    """`--overwrite` starts a new run in a finished folder: were that run killed (SIGKILL, a lost node)
    before its end, the old run's "completed" summary and model would make a requeued `--resume`
    answer "run already complete" and drop the new run's checkpoints."""
    from types import SimpleNamespace

    from cembed.train.checkpoint import completed_run
    from cembed.train.recipe import prepare_output

    out = tmp_path / "done"
    out.mkdir()
    (out / "modules.json").write_text("[]")
    train = {"max_steps": 4, "num_train_epochs": None}
    (out / "run_summary.json").write_text(json.dumps({"status": "completed", "config": {"train": train}}))
    assert completed_run(out, 4, None)
    prepare_output(str(out), 4, SimpleNamespace(lr_derivation="0.01"), False, None, overwrite=True)
    assert not (out / "run_summary.json").exists() and not completed_run(out, 4, None)
    assert "start: fresh run" in (out / "train.log").read_text()


def _validate(write_config, train_path, **data):
    path = write_config(
        {"data": {"train": str(train_path), **data}, "batch": {"per_device_train_batch_size": 2, "mini_batch_size": 1}}
    )
    return CliRunner().invoke(app, ["validate", str(path)])


def _gz(path, payload: bytes):
    path.write_bytes(gzip.compress(payload))
    return path


BAD_INPUTS = {
    "empty file": (lambda p: (p / "e.jsonl").write_text("") and None or p / "e.jsonl", "data file is empty"),
    "corrupt gzip": (
        lambda p: (p / "c.jsonl.gz").write_bytes(b"\x1f\x8b\x08\x00garbage-not-deflate") and None or p / "c.jsonl.gz",
        "corrupt or truncated gzip",
    ),
    "truncated gzip": (
        lambda p: (
            (p / "t.jsonl.gz").write_bytes(gzip.compress(b'{"anchor": "a", "positive": "b"}\n' * 200)[:60])
            and None
            or p / "t.jsonl.gz"
        ),
        "corrupt or truncated gzip",
    ),
    "invalid JSON on line 3": (
        lambda p: (
            (p / "j.jsonl").write_text(
                '{"anchor": "a", "positive": "b"}\n{"anchor": "c", "positive": "d"}\n{"anchor": "e", "positive": \n'
            )
            and None
            or p / "j.jsonl"
        ),
        "invalid JSON on line 3",
    ),
    "ragged CSV": (
        lambda p: (p / "r.csv").write_text("anchor,positive\na,b\nc,d,e\nf,g\n") and None or p / "r.csv",
        "line 3: 3 fields, but the header has 2",
    ),
    "short CSV row": (
        lambda p: (p / "s.csv").write_text("anchor,positive\na,b\nc\nf,g\n") and None or p / "s.csv",
        "line 3: 1 fields, but the header has 2",
    ),
    "list column": (
        lambda p: (
            (p / "l.jsonl").write_text(
                "".join(json.dumps({"anchor": [f"a{i}"], "positive": f"b{i}"}) + "\n" for i in range(4))
            )
            and None
            or p / "l.jsonl"
        ),
        "holds list",
    ),
    "number column": (
        lambda p: (
            (p / "n.jsonl").write_text("".join(json.dumps({"anchor": i, "positive": f"b{i}"}) + "\n" for i in range(4)))
            and None
            or p / "n.jsonl"
        ),
        "holds int64 values; it must hold text",
    ),
    "text over 1 MB": (
        lambda p: (
            (p / "big.jsonl").write_text(
                "".join(
                    json.dumps({"anchor": ("x" * 1_000_001 if i == 2 else f"a{i}"), "positive": f"b{i}"}) + "\n"
                    for i in range(4)
                )
            )
            and None
            or p / "big.jsonl"
        ),
        "line 3: column 'anchor' (role anchor) is longer than 1 MB",
    ),
    "non-UTF-8 bytes": (
        lambda p: (
            (p / "u.jsonl").write_bytes(b'{"anchor": "a", "positive": "b"}\n{"anchor": "caf\xe9", "positive": "d"}\n')
            and None
            or p / "u.jsonl"
        ),
        "line 2: bytes that are not UTF-8",
    ),
    "a folder": (
        lambda p: (p / "folder.jsonl").mkdir() or p / "folder.jsonl",
        "folder.jsonl: the folder holds no .jsonl, .json, .csv, .tsv (each also .gz, .bz2, .xz or .zst)",
    ),  # a folder is a sharded source
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_clear_error(case, write_config, tmp_path):
    make, expected = BAD_INPUTS[case]
    r = _validate(write_config, make(tmp_path))
    assert r.exit_code == 2, r.output
    assert expected in r.output, r.output
    assert "Traceback" not in r.output and not isinstance(r.exception, Exception) or isinstance(r.exception, SystemExit)


@pytest.mark.slow
def test_bad_rows_dropped_and_counted(write_config, pairs_file):
    rows = distinct_pairs(8)
    rows[1]["anchor"] = "x" * 1_000_001
    rows[4]["positive"] = None
    r = _validate(write_config, pairs_file(rows), drop_invalid_rows=True)
    assert r.exit_code == 0, r.output
    assert "8 rows read, 2 dropped, 6 to train on" in r.output


def test_config_that_is_a_list(write_config):
    r = CliRunner().invoke(app, ["validate", str(write_config("- data\n- batch\n"))])
    assert r.exit_code == 2 and "must be a mapping of sections" in r.output


@pytest.mark.slow
def test_resume_refuses_finished_or_changed_schedule(tiny_model_dir, write_config, tmp_path):
    path = _config(write_config, tmp_path, tiny_model_dir, tmp_path / "short", max_steps=2, save_steps=1)
    cfg = load_config(path)
    plan, data = check_run_inputs(cfg)
    old_mask = os.umask(0o022)
    try:
        run_training(cfg, plan, data)
    finally:
        os.umask(old_mask)
    # checkpoints get the umask's modes too (transformers writes the weights 0o600)
    assert stat.S_IMODE((tmp_path / "short" / "checkpoint-1" / "model.safetensors").stat().st_mode) == 0o644
    with pytest.raises(
        UserError, match=r"checkpoint-2 is at step 2, already at train.max_steps=2 and its run finished; nothing to"
    ):
        run_training(cfg, plan, data, resume=True)
    longer = load_config(path, ["train.max_steps=4"])
    with pytest.raises(UserError, match=r"belongs to a run of 2 steps, but train.max_steps is 4"):
        run_training(longer, plan, data, resume_from=str(tmp_path / "short" / "checkpoint-1"))
    with pytest.raises(UserError, match=r"--resume-from .*checkpoint-9: no such checkpoint folder"):
        run_training(cfg, plan, data, resume_from=str(tmp_path / "short" / "checkpoint-9"))
    # A finished folder without checkpoints does not suggest --resume.
    nockpt = _config(write_config, tmp_path, tiny_model_dir, tmp_path / "nockpt", max_steps=1)
    c2 = load_config(nockpt)
    run_training(c2, plan, data)
    with pytest.raises(UserError) as err:
        run_training(c2, plan, data)
    assert "pass --overwrite to replace it, or choose" in str(err.value) and "--resume" not in str(err.value)


def test_override_errors_name_the_override(write_config, pairs_file):
    path = write_config(
        {
            "data": {"train": str(pairs_file(distinct_pairs(8)))},
            "batch": {"per_device_train_batch_size": 4, "mini_batch_size": 2},
        }
    )
    with pytest.raises(
        UserError, match=r"^override 'batch.per_device_train_batch_size=abc': batch.per_device_train_batch_size: "
    ):
        load_config(path, ["batch.per_device_train_batch_size=abc"])
    with pytest.raises(UserError, match=r"^override 'optim.lr=1e-4': unknown key 'optim.lr'"):
        load_config(path, ["optim.lr=1e-4"])
    with pytest.raises(UserError, match=r"is a folder; give the YAML config file"):
        load_config(path.parent)
