"""Issue 12: what validate passes, train runs; what a run did, its summary says.

Pre-flight checks (model limits, scheduler arguments, metric names, tokenizer padding), conflicting
length settings, failures recorded whatever the exception, and resume refusing a changed config."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import yaml
from conftest import make_tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from cembed.cli.app import app
from cembed.config.schema import SCHEDULERS

ROWS = [{"anchor": f"question {i} about a red car", "positive": f"answer {i} on the street"} for i in range(16)]
STS = [{"sentence1": f"a {w} dog", "sentence2": f"the {w} dog", "score": float(i)} for i, w in enumerate("abcdef")]


@pytest.fixture(scope="module")
def short_model_dir(tmp_path_factory):
    """A tiny BERT whose position table has 40 entries."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny40"), positions=40)


def _cfg(model_dir, data, out, /, **sections):
    cfg = {
        "model": {"name_or_path": str(model_dir), "device": "cpu"},
        "data": {"train": str(data), "pretokenize": False},
        "batch": {"per_device_train_batch_size": 4, "mini_batch_size": 2},
        "optim": {"learning_rate": 2e-5, "base_batch_size": 4},
        "train": {"max_steps": 2, "logging_steps": 1, "output_dir": str(out), "seed": 3},
    }
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values} if values is not None else None
    return cfg


def _invoke(*args):
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert "Traceback" not in r.output, r.output
    return r


def _one_error(r, code: int, text: str):
    assert r.exit_code == code, r.output
    lines = [line for line in r.output.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and text in lines[0], r.output


CASE_1 = {
    "position table": (
        {"model": {"max_seq_length": 128}},
        "model.max_seq_length: 128 is longer than the model's position table (40 positions, bert); "
        "set model.max_seq_length to at most 40",
    ),
    "warmup_stable_decay without its arguments": (
        {"optim": {"lr_scheduler_type": "warmup_stable_decay"}},
        "optim.lr_scheduler_kwargs: lr_scheduler_type warmup_stable_decay needs num_decay_steps",
    ),
    "polynomial end LR above the effective LR": (
        {"optim": {"lr_scheduler_type": "polynomial", "learning_rate": 5e-8, "lr_scaling": "none"}},
        "optim.learning_rate: the effective LR 5.000e-08 is not above the polynomial schedule's end LR 1e-07",
    ),
    "a scheduler argument it does not take": (
        {"optim": {"lr_scheduler_type": "cosine", "lr_scheduler_kwargs": {"bogus": 1}}},
        "optim.lr_scheduler_kwargs: cosine does not accept these arguments",
    ),
    "metric loss without a loss-producing eval": (
        {"eval": {"sts": "STS", "eval_steps": 1, "metric_for_best_model": "loss"}},
        "eval.metric_for_best_model: 'loss' needs an evaluation loss, which the eval sets do not produce",
    ),
    "a tokenizer that cannot pad": (
        {"model": {"tokenizer_kwargs": {"pad_token": None}}},
        "model.tokenizer_kwargs: the tokenizer has no padding token",
    ),
    "pad_to_multiple_of above max_seq_length": (
        {"model": {"max_seq_length": 32}, "batch": {"pad_to_multiple_of": 64}, "data": {"pretokenize": True}},
        "batch.pad_to_multiple_of: 64 is above model.max_seq_length 32: no batch width can be a multiple of it "
        "(every batch would be padded to 32); set it to at most 32 or leave it unset",
    ),
    "pad_to_multiple_of above the model's own length": (
        {"batch": {"pad_to_multiple_of": 48}, "data": {"pretokenize": True}},  # the model's own max_seq_length: 40
        "batch.pad_to_multiple_of: 48 is above the model's max_seq_length 40:",
    ),
    "pad_to_multiple_of where sentence-transformers' collator tokenizes": (
        {"batch": {"pad_to_multiple_of": 8}},  # _cfg's data.pretokenize: false
        "batch.pad_to_multiple_of: 8 has no effect with data.pretokenize: false (sentence-transformers' collator "
        "tokenizes each batch and pads it to its longest row); set data.pretokenize: true or leave "
        "batch.pad_to_multiple_of unset",
    ),
    "num_train_epochs and max_steps both set": (
        {"train": {"num_train_epochs": 3, "max_steps": 2}},
        "num_train_epochs (3) and max_steps (2) are both set; max_steps would win",
    ),
}


@pytest.mark.parametrize("case", list(CASE_1))
def test_knowable_mistakes_fail_validate_and_train_alike(case, short_model_dir, write_config, pairs_file, tmp_path):
    sections, expected = CASE_1[case]
    sts = pairs_file(STS, "sts.jsonl")
    if "eval" in sections:
        sections = {"eval": {**sections["eval"], "sts": str(sts)}}
    path = write_config(_cfg(short_model_dir, pairs_file(ROWS), tmp_path / "run", **sections))
    _one_error(_invoke("validate", path), 2, expected)
    _one_error(_invoke("train", path), 2, expected)
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.slow
def test_fixed_settings_train(short_model_dir, write_config, pairs_file, tmp_path):
    # The fixes the messages name make the run train.
    path = write_config(
        _cfg(
            short_model_dir,
            pairs_file(ROWS),
            tmp_path / "run",
            model={"max_seq_length": 40},
            optim={"lr_scheduler_type": "warmup_stable_decay", "lr_scheduler_kwargs": {"num_decay_steps": 1}},
        )
    )
    r = _invoke("train", path)
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "run" / "run_summary.json").read_text())["steps"] == 2


def _raise_at_call(n, exc):
    import cembed.train.recipe as T

    real = T.build_loss

    def build(*args, **kwargs):
        built = real(*args, **kwargs)
        forward, calls = built.module.forward, {"n": 0}

        def patched(features, labels):
            calls["n"] += 1
            if calls["n"] == n:
                raise exc
            return forward(features, labels)

        built.module.forward = patched
        return built

    return build


@pytest.mark.slow
def test_unexpected_exception_is_recorded(tiny_model_dir, write_config, pairs_file, tmp_path, monkeypatch):
    monkeypatch.setattr(
        "cembed.train.recipe.build_loss", _raise_at_call(2, RuntimeError("size of tensor a (109) vs b (40)"))
    )
    out = tmp_path / "run"
    path = write_config(_cfg(tiny_model_dir, pairs_file(ROWS), out, train={"save_steps": 1}))
    r = _invoke("train", path)
    _one_error(r, 3, "run failed at step 1: RuntimeError: size of tensor a (109) vs b (40); last good checkpoint: ")
    assert "checkpoint-1; traceback in " in r.output
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["status"] == "failed" and summary["error_type"] == "RuntimeError" and summary["steps"] == 1
    assert summary["last_good_checkpoint"].endswith("checkpoint-1") and summary["config"]["train"]["save_steps"] == 1
    tb = (out / "error_traceback.txt").read_text()
    assert tb.startswith("Traceback") and "size of tensor a (109)" in tb
    assert "failed: run failed at step 1: RuntimeError" in (out / "train.log").read_text()


def test_unexpected_exception_before_the_run(tiny_model_dir, write_config, pairs_file, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise KeyError("eval_loss")

    monkeypatch.setattr("cembed.train.recipe.check_run_inputs", broken)
    r = _invoke("train", write_config(_cfg(tiny_model_dir, pairs_file(ROWS), tmp_path / "run")))
    _one_error(r, 1, "unexpected KeyError: 'eval_loss' (traceback in ")
    tb = r.output.split("(traceback in ")[1].split(")")[0]
    assert "KeyError" in open(tb).read()


@pytest.mark.slow
def test_resume_refuses_a_changed_config(tiny_model_dir, write_config, pairs_file, tmp_path):
    out, data = tmp_path / "run", pairs_file(ROWS)
    path = write_config(_cfg(tiny_model_dir, data, out, train={"max_steps": 4, "save_steps": 2}))
    assert _invoke("train", path).exit_code == 0
    ckpt = out / "checkpoint-2"
    r = _invoke("train", path, "batch.per_device_train_batch_size=8", "optim.learning_rate=1e-3", "--resume-from", ckpt)
    _one_error(r, 2, f"cannot resume {ckpt} with a changed config: ")
    for change in (
        "batch.per_device_train_batch_size 4 -> 8",
        "effective_learning_rate 2e-05 -> 0.001",
        "optim.learning_rate 2e-05 -> 0.001",
        "samples_per_step 4 -> 8",
    ):
        assert change in r.output, r.output
    # Changed data under the same path is a change too.
    data.write_text(data.read_text() + json.dumps({"anchor": "new question", "positive": "new answer"}) + "\n")
    _one_error(_invoke("train", path, "--resume-from", ckpt), 2, "data_fingerprint '16 rows, ")
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    # A change that does not alter training is applied and recorded (--overwrite: the folder's
    # checkpoint-4 belongs to the run this one replaces from step 2).
    r = _invoke("train", path, "train.logging_steps=2", "--resume-from", ckpt, "--overwrite")
    assert r.exit_code == 0, r.output
    assert "resume applies train.logging_steps 1 -> 2" in r.output
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["resume_changes"] == ["train.logging_steps 1 -> 2"]
    assert summary["steps"] == 4 and summary["samples_seen"] == 16 and summary["learning_rate"]["effective"] == 2e-5


@pytest.mark.slow
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    scheduler=st.sampled_from(SCHEDULERS),
    kwargs=st.sampled_from([{}, {"num_decay_steps": 1}, {"num_decay_steps": 1}, {"lr_end": 1e-4}, {"bogus": 1}]),
    lr=st.sampled_from([5e-8, 2e-5, 1e-3]),
    metric=st.sampled_from([None, None, "loss", "sts_spearman_cosine", "eval_sts_pearson_cosine", "nope"]),
    length=st.sampled_from([(None, 1), (1, None), (0.5, None), (1, 1), (None, None)]),
    max_seq_length=st.sampled_from([None, 8, 40, 40, 41, 128]),
)
def test_validate_ok_means_train_runs(short_model_dir, scheduler, kwargs, lr, metric, length, max_seq_length):
    # Acceptance: a config either fails validate (exit 2) or trains (exit 0), never validate OK then a crash.
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:8]))
        (tmp / "sts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in STS))
        epochs, steps = length
        cfg = _cfg(
            short_model_dir,
            tmp / "pairs.jsonl",
            tmp / "run",
            model={"max_seq_length": max_seq_length},
            optim={"lr_scheduler_type": scheduler, "lr_scheduler_kwargs": kwargs, "learning_rate": lr},
            train={"num_train_epochs": epochs, "max_steps": steps},
        )
        if metric:
            cfg["eval"] = {"sts": str(tmp / "sts.jsonl"), "eval_steps": 1, "metric_for_best_model": metric}
        (tmp / "c.yaml").write_text(yaml.safe_dump(cfg))
        r = _invoke("validate", tmp / "c.yaml")
        assert r.exit_code in (0, 2), r.output
        if r.exit_code == 2:
            return
        r = _invoke("train", tmp / "c.yaml")
        assert r.exit_code == 0, r.output
        assert json.loads((tmp / "run" / "run_summary.json").read_text())["steps"] >= 1


def test_resume_may_declare_ignored_columns():
    # Issue 23 item 11: the quickstart now says `columns.ignore: [image_id, ...]`; the ignored columns
    # were not trained before either, so a checkpoint recorded without the field resumes.
    from cembed.train.preflight import resume_differences

    columns = {"anchor": "anchor", "positive": "positive", "negatives": []}
    old = {"config": {"data": {"columns": columns, "train": {"path": "x.jsonl", "columns": columns}}}}
    new = {
        "config": {
            "data": {
                "columns": {**columns, "ignore": ["image_id"]},
                "train": {"path": "x.jsonl", "columns": {**columns, "ignore": ["id"]}},
            }
        }
    }
    assert resume_differences(old, new) == (
        [],
        ["data.columns.ignore None -> ['image_id']", "data.train.columns.ignore None -> ['id']"],
    )
    new["config"]["data"]["columns"]["anchor"] = "query"  # what is trained: still refused
    assert resume_differences(old, new)[0] == ["data.columns.anchor 'anchor' -> 'query'"]


def test_a_checkpoint_from_before_sampler_rule_resumes_with_the_default_rule():
    from cembed.train.preflight import resume_differences

    old = {"config": {"sampler": {"no_duplicates": True}}}
    new = {"config": {"sampler": {"no_duplicates": True, "rule": "no_duplicates"}}}
    assert resume_differences(old, new) == ([], [])
    new["config"]["sampler"]["rule"] = "fixed_order"  # another rule draws other batches: refused
    assert resume_differences(old, new)[0] == ["sampler.rule 'no_duplicates' -> 'fixed_order'"]


# --- issue 32 item 4: trackers and the folders a run writes ------------------------------------------


def test_folder_problem_names_each_mistake(tmp_path, monkeypatch):
    import os

    from cembed.train.preflight import folder_problem

    (tmp_path / "f").write_text("x")
    assert folder_problem(tmp_path / "new" / "run") is None  # created on demand under a writable folder
    assert folder_problem(tmp_path / "f").endswith("/f is a file, not a folder")
    assert folder_problem(tmp_path / "f" / "run").endswith(
        "/f/run cannot be created: " + str(tmp_path / "f") + " is a file"
    )
    # root writes anywhere, so "not writable" is os.access saying no for the nearest existing folder
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: real(p, mode) and Path(p) != tmp_path)
    assert folder_problem(tmp_path / "new" / "run") == f"{tmp_path} is not writable"


def test_trackers_are_checked_by_transformers_availability(monkeypatch):
    import transformers.integrations as integrations

    from cembed.train.preflight import check_trackers

    monkeypatch.setattr(integrations, "get_available_reporting_integrations", lambda: ["wandb"])
    assert check_trackers(["none"]) == [] and check_trackers(["all"]) == [] and check_trackers(["wandb"]) == []
    (finding,) = check_trackers(["wandb", "tensorboard", "comet_ml"])
    assert finding.field == "train.report_to"
    assert finding.message == (
        "tensorboard, comet_ml are not installed; pip install tensorboard comet-ml, or remove them from train.report_to"
    )


def test_a_warmup_that_takes_every_step_is_refused_for_the_polynomial_schedule():
    """transformers' polynomial decay divides by (steps - warmup): one step at warmup_ratio 0.1 has
    ceil(0.1) = 1 warmup step and nothing to decay over (found by the property test below: validate
    said OK, train crashed at step 0 with ZeroDivisionError)."""
    from cembed.config.schema import OptimConfig
    from cembed.train.preflight import check_scheduler

    (finding,) = check_scheduler(OptimConfig(lr_scheduler_type="polynomial"), 2e-5, max_steps=1)
    assert finding.field == "optim.warmup_ratio"
    assert finding.message == (
        "polynomial: the warmup (1 step(s) = ceil(0.1 x 1)) leaves no step to decay over; lower "
        "optim.warmup_ratio or train more steps"
    )
    assert check_scheduler(OptimConfig(lr_scheduler_type="polynomial"), 2e-5, max_steps=2) == []
    assert check_scheduler(OptimConfig(lr_scheduler_type="linear"), 2e-5, max_steps=1) == []  # guarded there
