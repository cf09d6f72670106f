"""cembed.train.summary: the entries every run_summary.json has, the per-source and samples-seen
numbers of a completed run (counted by hand from the sampler's batches), what a failed run leaves
(summary, log line, traceback, one-line error), what passes through for an interrupted one, and
the before/after eval rows; and three tiny in-process runs (completed, interrupted by SIGTERM in
step 2, failed in step 2) whose summaries hold exactly the base entries plus their own."""

from __future__ import annotations

import json
import os
import signal
from dataclasses import replace
from types import SimpleNamespace

import pytest
from conftest import distinct_pairs
from datasets import Dataset

from cembed.cli.display.run import eval_change_rows
from cembed.config.file import config_from_dict, load_config
from cembed.data.batching.full_table import NoDuplicatesSampler
from cembed.data.batching.mixture import SourceMix
from cembed.data.rows import LoadedSource, TrainingData
from cembed.errors import RunFailed, RunInterrupted, UserError
from cembed.plan.resolve import resolve_plan
from cembed.train.checkpoint import MARKER, latest_complete, mark_complete
from cembed.train.recipe import QuietRunDisplay, check_run_inputs, run_training
from cembed.train.summary import (
    TRACEBACK_FILE,
    Attempt,
    failed_summary,
    failures_recorded,
    samples_seen,
    source_summary,
    summary_base,
)
from cembed.train.trainer import CembedTrainer


def _data(sizes=(10, 4)) -> TrainingData:
    n = sum(sizes)
    dataset = Dataset.from_dict({"anchor": [f"q{i}" for i in range(n)], "positive": [f"p{i}" for i in range(n)]})
    sources, offset = [], 0
    for name, size in zip(("nli", "qa"), sizes):
        files = 20 if name == "nli" else None  # nli: a folder of 20 shards
        sources.append(
            LoadedSource(name, f"{name}.jsonl", f"data.train.{name}", size + 1, 1, size, offset, files=files)
        )
        offset += size
    return TrainingData(dataset, "nli.jsonl, qa.jsonl", n + 2, 2, {"anchor": "anchor"}, sources)


def _trainer(batch_sampler, accumulation=1, step=0):
    return SimpleNamespace(
        get_train_dataloader=lambda: SimpleNamespace(batch_sampler=batch_sampler),
        args=SimpleNamespace(gradient_accumulation_steps=accumulation),
        state=SimpleNamespace(global_step=step),
    )


@pytest.fixture
def sampler():
    # nli: 10 rows in batches of 4 without drop_last -> 4, 4, 2; qa: 4 rows -> 4. Proportional
    # schedule of (3, 1) batches: nli (3/4), nli (1/2 vs 1/2, tie), qa (1/4 vs 3/4), nli.
    data = _data()
    mix = SourceMix(("nli", "qa"), (10, 4))
    return NoDuplicatesSampler(data.dataset, batch_size=4, drop_last=False, seed=0, world_size=1, sources=mix)


def test_batches_and_rows_per_source(sampler):
    data = _data()
    assert sampler.batch_sources() == [0, 0, 1, 0]
    assert source_summary(data, _trainer(sampler)) == [
        {
            "name": "nli",
            "source": "nli.jsonl",
            "rows_read": 11,
            "rows_dropped_invalid": 1,
            "rows": 10,
            "files": 20,
            "batches_per_epoch": 3,
        },
        {
            "name": "qa",
            "source": "qa.jsonl",
            "rows_read": 5,
            "rows_dropped_invalid": 1,
            "rows": 4,
            "files": 1,
            "batches_per_epoch": 1,
        },
    ]
    # 6 steps: epoch 0's four batches (4 + 4 + 4 + 2 rows), then epoch 1's first two (both nli: 4 + 4)
    trained = source_summary(data, _trainer(sampler), steps=6)
    assert [(s["batches_trained"], s["rows_trained"]) for s in trained] == [(5, 18), (1, 4)]
    assert samples_seen(_trainer(sampler), 6, samples_per_step=4) == 22
    assert samples_seen(_trainer(sampler), 4, samples_per_step=4) == 14  # the short batch counts its 2 rows


def test_accumulation_counts_batches_per_step(sampler):
    # 2 batches per optimizer step: 2 steps per epoch; 3 steps = epoch 0 (14 rows) + epoch 1's first step
    assert samples_seen(_trainer(sampler, accumulation=2), 3, samples_per_step=8) == 14 + 8
    trained = source_summary(_data(), _trainer(sampler, accumulation=2), steps=1)
    assert [(s["batches_trained"], s["rows_trained"]) for s in trained] == [(2, 8), (0, 0)]


def test_without_the_no_duplicates_sampler():
    plain = _trainer(batch_sampler=object())
    assert samples_seen(plain, 5, samples_per_step=32) == 160
    assert [s["batches_per_epoch"] for s in source_summary(_data(), plain, steps=5)] == [None, None]
    assert "batches_trained" not in source_summary(_data(), plain, steps=5)[0]


def test_summary_base_entries(tmp_path, sampler, monkeypatch):
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    cfg = config_from_dict(
        {"data": {"train": "x.jsonl"}, "model": {"device": "cpu"}, "batch": {"mini_batch_size": "auto"}}, base=tmp_path
    )
    plan = replace(resolve_plan(cfg, world_size=1), mini_batch_size=16, mini_batch_probe={"rows": 16})  # as probed
    data = _data()
    parts = SimpleNamespace(
        sources=SimpleNamespace(strategy="proportional"),
        token_info={"max_seq_length": 64},
        weights=None,
        loss=SimpleNamespace(unpadding=SimpleNamespace(to_dict=lambda: {"mode": "padded"})),
        distributed=None,
    )
    run_dir = SimpleNamespace(checkpoint="ck-3", resume_changes=("x",), out=tmp_path / "out", restarts=0)
    run = SimpleNamespace(batches_per_epoch=4, rows_unplaced=0, trainer=_trainer(sampler))
    base = summary_base(cfg, plan, data, parts, run_dir, run)
    assert base["config"]["batch"]["mini_batch_size"] == 16  # the config as run: auto shows the probed size
    assert cfg.batch.mini_batch_size == "auto"  # the config itself is not changed
    assert base["plan"] == plan.to_dict()
    assert base["learning_rate"] == {"effective": plan.learning_rate, "derivation": plan.lr_derivation}
    assert {k: v for k, v in base["data"].items() if k != "sources"} == {
        "source": "nli.jsonl, qa.jsonl",
        "rows_read": 16,
        "rows_dropped_invalid": 2,
        "rows_trained": 14,
        "columns": {"anchor": "anchor"},
        "batches_per_epoch": 4,
        "rows_unplaced_first_epoch": 0,
        "sampling": "proportional",
    }
    assert [s["batches_per_epoch"] for s in base["data"]["sources"]] == [3, 1]
    assert (base["resumed_from"], base["resume_changes"], base["weights"]) == ("ck-3", ["x"], None)
    assert (base["attention"], base["device"], base["mini_batch_probe"]) == ({"mode": "padded"}, "cpu", {"rows": 16})
    assert base["precision"] == {
        "requested": "auto",
        "resolved": "fp32",
        "tf32": False,
        "reason": plan.precision_reason,
    }
    assert base["output_dir"] == str(tmp_path / "out")
    assert set(base["versions"]) == {"python", "cembed", "torch", "transformers", "sentence-transformers", "datasets"}
    json.dumps(base)  # the summary is JSON as it is


def test_failed_run_recorded(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoint-4").mkdir(parents=True)
    mark_complete(out / "checkpoint-4", 4)
    (out / "checkpoint-6").mkdir()  # half-written: not the last good one
    attempt = Attempt(base={"plan": {"samples_per_step": 8}}, trainer=_trainer(None, step=7))
    with pytest.raises(RunFailed) as caught, failures_recorded(out, True, attempt):
        raise RuntimeError("CUDA error: device-side assert\nsecond line")
    checkpoint = str(out / "checkpoint-4")
    assert str(caught.value) == (
        f"run failed at step 7: RuntimeError: CUDA error: device-side assert; last good checkpoint: {checkpoint}; "
        f"traceback in {out / TRACEBACK_FILE}"
    )
    assert isinstance(caught.value.__cause__, RuntimeError) and caught.value.exit_code == 3
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary == {
        "plan": {"samples_per_step": 8},
        "status": "failed",
        "error": "CUDA error: device-side assert\nsecond line",
        "error_type": "RuntimeError",
        "steps": 7,
        "last_good_checkpoint": checkpoint,
        "traceback": str(out / TRACEBACK_FILE),
    }
    traceback = (out / TRACEBACK_FILE).read_text()
    assert traceback.startswith("Traceback (most recent call last):") and "second line" in traceback
    (log,) = (out / "train.log").read_text().splitlines()
    assert log.endswith(f" failed: {caught.value}")


def test_failure_before_the_trainer_and_on_other_ranks(tmp_path):
    with pytest.raises(RunFailed, match=r"^run failed at step 0: KeyError: 'x'; last good checkpoint: none; "):
        with failures_recorded(tmp_path, True, Attempt()):
            raise KeyError("x")
    assert json.loads((tmp_path / "run_summary.json").read_text())["steps"] == 0
    other = tmp_path / "rank1"
    other.mkdir()
    with pytest.raises(RunFailed, match=f"traceback in {other / TRACEBACK_FILE}$"):
        with failures_recorded(other, False, Attempt()):
            raise ValueError("bad")
    assert list(other.iterdir()) == []  # only rank 0 writes


def test_a_collective_timeout_is_named_as_such(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    gloo = "[../gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 6000ms for send operation to complete"
    with (
        pytest.raises(RunFailed) as caught,
        failures_recorded(tmp_path, False, Attempt(trainer=_trainer(None, step=4))),
    ):
        raise RuntimeError(gloo)
    assert str(caught.value) == (
        "a collective timed out after 6 s on rank 1 in step 5: another rank did not reach it (hung, crashed, or "
        "slower than the timeout); raise distributed.timeout_minutes or check the other ranks' logs; last good "
        f"checkpoint: none; traceback in {tmp_path / TRACEBACK_FILE}"
    )


@pytest.mark.parametrize("err", [UserError("a user error"), RunFailed("nan at step 2"), RunInterrupted(2, 3, "ck")])
def test_user_errors_and_interruptions_pass_through(tmp_path, err):
    with pytest.raises(type(err)) as caught, failures_recorded(tmp_path, True, Attempt(base={})):
        raise err
    assert caught.value is err
    assert list(tmp_path.iterdir()) == []  # the train stage writes those records itself
    if isinstance(err, RunInterrupted):
        assert (str(err), err.exit_code) == ("interrupted by SIGINT at step 3", 128 + signal.SIGINT)


def test_failed_summary_without_traceback():
    summary = failed_summary({"a": 1}, OSError("disk full"), 3, None, None)
    assert summary == {
        "a": 1,
        "status": "failed",
        "error": "disk full",
        "error_type": "OSError",
        "steps": 3,
        "last_good_checkpoint": None,
        "traceback": None,
    }


def test_eval_change_rows():
    block = {
        "before": {"sci_cosine_recall@10": 0.5, "sci_cosine_ndcg@10": 0.25, "sts_spearman_cosine": 0.75},
        "after": {
            "sts_spearman_cosine": 0.5,
            "sci_cosine_ndcg@10": 0.5,
            "sci_cosine_recall@10": 0.75,
            "sci_cosine_mrr@10": 0.9,  # not compared
            "new_cosine_ndcg@10": 0.125,  # no before
        },
    }
    assert eval_change_rows(block) == [
        ("sci_cosine_ndcg@10", 0.25, 0.5, 0.25),
        ("sci_cosine_recall@10", 0.5, 0.75, 0.25),
        ("sts_spearman_cosine", 0.75, 0.5, -0.25),
        ("new_cosine_ndcg@10", None, 0.125, None),
    ]
    assert eval_change_rows(None) == [] and eval_change_rows({"before": None, "after": {}}) == []


# Entries only a completed run's summary has (beside summary_base's, status and steps).
COMPLETED_ONLY = {
    "epochs",
    "samples_seen",
    "steps_this_run",
    "samples_this_run",
    "loss_notes",
    "wall_time_s",
    "samples_per_s",
    "train_loss",
    "first_loss",
    "last_loss",
    "losses",
    "step_losses",
    "nonfinite_steps_skipped",
    "throughput",
    "lora",
    "throughput_per_interval",
    "eval",
    "plot",
}


class _StopAtStep2(CembedTrainer):
    """Signals itself during step 2 (SIGTERM) or fails in it, as a real run would."""

    fail = False

    def training_step(self, *args, **kwargs):
        if self.state.global_step == 1:
            if self.fail:
                raise RuntimeError("boom in step 2")
            os.kill(os.getpid(), signal.SIGTERM)
        return super().training_step(*args, **kwargs)


class _FailAtStep2(_StopAtStep2):
    fail = True


def _tiny_run(tiny_model_dir, write_config, pairs_file, tmp_path, monkeypatch, **train):
    monkeypatch.setenv("CEMBED_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "run"
    cfg = load_config(
        write_config(
            {
                "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
                "data": {"train": str(pairs_file(distinct_pairs(16)))},
                "batch": {"per_device_train_batch_size": 4, "mini_batch_size": 2},
                "train": {"max_steps": 3, "logging_steps": 1, "output_dir": str(out), **train},
            }
        )
    )
    plan, data = check_run_inputs(cfg)
    return cfg, plan, data, out


@pytest.mark.slow
def test_completed_interrupted_and_failed_runs(tiny_model_dir, write_config, pairs_file, tmp_path, monkeypatch):
    cfg, plan, data, out = _tiny_run(tiny_model_dir, write_config, pairs_file, tmp_path / "a", monkeypatch)
    done = run_training(cfg, plan, data)
    assert json.loads((out / "run_summary.json").read_text())["status"] == "completed"
    # 3 steps of 4 distinct rows (16 rows: 4 batches per epoch)
    assert (done["status"], done["steps"], done["samples_seen"]) == ("completed", 3, 12)
    assert done["data"]["batches_per_epoch"] == 4 and done["data"]["rows_trained"] == 16
    assert [(s["batches_trained"], s["rows_trained"]) for s in done["data"]["sources"]] == [(3, 12)]
    assert done["config"]["batch"]["mini_batch_size"] == 2 and done["plan"]["samples_per_step"] == 4

    cfg, plan, data, out = _tiny_run(tiny_model_dir, write_config, pairs_file, tmp_path / "b", monkeypatch)
    with pytest.raises(RunInterrupted) as caught:
        run_training(cfg, plan, data, trainer_cls=_StopAtStep2)
    assert (caught.value.signum, caught.value.step) == (signal.SIGTERM, 2)
    stopped = json.loads((out / "run_summary.json").read_text())
    # step 2 finished, was saved as a complete checkpoint, and the summary has every base entry
    assert (stopped["status"], stopped["steps"], stopped["checkpoint"]) == ("interrupted", 2, str(out / "checkpoint-2"))
    assert latest_complete(out) == out / "checkpoint-2"
    # and every step's loss so far (the resume reads them back from the checkpoint)
    assert set(stopped) == {k for k in done if k not in COMPLETED_ONLY} | {"checkpoint", "step_losses"}
    assert [step for step, _ in stopped["step_losses"]] == [1, 2]
    assert "status" not in json.loads((out / "checkpoint-2" / MARKER).read_text())  # the marker is not a summary

    cfg, plan, data, out = _tiny_run(
        tiny_model_dir, write_config, pairs_file, tmp_path / "c", monkeypatch, save_steps=1
    )
    with pytest.raises(RunFailed, match="^run failed at step 1: RuntimeError: boom in step 2; last good checkpoint: "):
        run_training(cfg, plan, data, trainer_cls=_FailAtStep2)
    failed = json.loads((out / "run_summary.json").read_text())
    assert (failed["status"], failed["steps"], failed["error"]) == ("failed", 1, "boom in step 2")
    assert failed["last_good_checkpoint"] == str(out / "checkpoint-1")
    assert "boom in step 2" in (out / TRACEBACK_FILE).read_text()
    assert set(failed) == {k for k in done if k not in COMPLETED_ONLY} | {
        "error",
        "error_type",
        "last_good_checkpoint",
        "traceback",
    }


@pytest.mark.slow
def test_a_resumed_run_reports_its_own_rate(tiny_model_dir, tmp_path):
    """Resumed at step 2 of 4 (8 samples a step): samples/s is the 16 samples this run trained over
    its wall time, not the 32 the model has seen; the display is told where the run continues."""
    rows = [{"anchor": f"question {i} about a car", "positive": f"answer {i} on the street"} for i in range(32)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    cfg = config_from_dict(
        {
            "model": {"name_or_path": str(tiny_model_dir), "max_seq_length": 16, "device": "cpu"},
            "data": {"train": str(tmp_path / "pairs.jsonl"), "pretokenize": False},
            "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 8},
            "train": {"max_steps": 4, "save_steps": 2, "logging_steps": 1, "output_dir": str(out)},
        },
        base=tmp_path,
    )
    plan, data = check_run_inputs(cfg)
    fresh = run_training(cfg, plan, data)

    class Resuming(QuietRunDisplay):
        def resuming(self, checkpoint, step, max_steps):
            self.told = (checkpoint, step, max_steps)

    display = Resuming()
    # (--overwrite: the folder's later checkpoint-4 belongs to the run this one replaces from step 2)
    summary = run_training(cfg, plan, data, display, resume_from=str(out / "checkpoint-2"), overwrite=True)
    assert summary["samples_per_s"] == pytest.approx(16 / summary["wall_time_s"], rel=0.01)
    assert (summary["steps"], summary["samples_seen"]) == (4, 32)
    assert (summary["steps_this_run"], summary["samples_this_run"]) == (2, 16)
    assert json.loads((out / "run_summary.json").read_text())["samples_per_s"] == summary["samples_per_s"]
    assert display.told == (str(out / "checkpoint-2"), 2, 4)
    assert (fresh["steps_this_run"], fresh["samples_this_run"]) == (4, 32)  # a fresh run: all of them


def test_a_prepared_source_reports_the_files_its_preparation_read():
    """``files`` of a prepared source is its manifest's ``input_files`` (2 shards prepared into 3
    parts: 2), None when the manifest does not know it (another engine wrote it)."""
    from cembed.data.tokens.format import PreparedManifest, PreparedPart

    parts = [PreparedPart(f"part-{k}.arrow", 2, 10) for k in range(3)]
    for input_files, expected in ((2, 2), (None, None)):
        manifest = PreparedManifest(["anchor", "positive"], "tok", 16, 6, parts, input_files=input_files)
        data = _data((6,))
        data.sources[0] = replace(data.sources[0], files=None, manifest=manifest)
        (entry,) = source_summary(data, _trainer(batch_sampler=object()))
        assert entry["files"] == expected
