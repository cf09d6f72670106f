"""The recipe shows a run only through the RunDisplay it is handed (cembed.train.recipe)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from transformers import TrainerCallback

import cembed.train.recipe as T
from cembed.config.file import config_from_dict


class RecordingDisplay:
    """A RunDisplay that records each call (name, arguments) and hands out a recording callback."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.callback_events: list[str] = []

    def probe_start(self, device):
        self.calls.append(("probe_start", device))

    def probe(self, result):
        self.calls.append(("probe", result))

    def run_header(self, cfg, plan, warnings):
        self.calls.append(("run_header", cfg, plan, warnings))

    def components(self, unpadding, distributed, warnings=()):
        self.calls.append(("components", unpadding, distributed))

    def progress(self, log, samples_per_step):
        self.calls.append(("progress", log, samples_per_step))
        events = self.callback_events

        class Recorder(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                events.append("train_begin")

            def on_step_end(self, args, state, control, **kwargs):
                events.append("step_end")

        return Recorder()

    def log_line(self, line):
        self.calls.append(("log_line", line))

    def eval_line(self, line):
        self.calls.append(("eval_line", line))

    def tokenize_progress(self):
        from contextlib import nullcontext

        return nullcontext()


def _tiny_config(tiny_model_dir, tmp_path, mini_batch_size):
    rows = [{"anchor": f"question {i} about a car", "positive": f"answer {i} on the street"} for i in range(16)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "sts.tsv").write_text(
        "".join(f"a car on road {i}\ta vehicle on a street {i}\t{i % 5}\n" for i in range(8))
    )
    return config_from_dict(
        {
            "model": {"name_or_path": str(tiny_model_dir), "max_seq_length": 16, "device": "cpu"},
            "data": {"train": str(tmp_path / "pairs.jsonl"), "cache_dir": str(tmp_path / "cache")},
            "batch": {"per_device_train_batch_size": 8, "mini_batch_size": mini_batch_size},
            "train": {"max_steps": 2, "logging_steps": 1, "output_dir": str(tmp_path / "out")},
            "eval": {"sts": str(tmp_path / "sts.tsv"), "eval_steps": 1},
        },
        base=tmp_path,
    )


@pytest.mark.slow
def test_a_recording_display_gets_every_call_of_a_run(tiny_model_dir, tmp_path, monkeypatch):
    """mini_batch_size: auto (the probe replaced by a stub: its child processes are slow on CPU) ->
    probe start and result, the header with the final plan, the components, the progress callback
    (added to the trainer: it sees the steps), one log line per logging interval and the evaluation
    lines before, during and after training."""
    probed = object()

    def fake_probe(plan, *args, **kwargs):
        return replace(plan, mini_batch_size=8), probed

    monkeypatch.setattr(T, "resolve_auto", fake_probe)
    cfg = _tiny_config(tiny_model_dir, tmp_path, "auto")
    plan, data = T.check_run_inputs(cfg)
    assert plan.mini_batch_size is None
    display = RecordingDisplay()
    summary = T.run_training(cfg, plan, data, display)
    assert summary["status"] == "completed" and summary["steps"] == 2

    names = [c[0] for c in display.calls]
    assert names[:5] == ["probe_start", "probe", "run_header", "components", "progress"]
    assert display.calls[0] == ("probe_start", "cpu")
    assert display.calls[1][1] is probed
    header_cfg, header_plan, findings = display.calls[2][1:]
    assert header_cfg is cfg and header_plan.mini_batch_size == 8 and findings == tuple(data.warnings)
    assert display.calls[3][1].description  # the attention path (cembed.model.unpad.Unpadding)
    assert display.calls[3][2] is None  # one process: no distributed block
    assert display.calls[4][2] == plan.samples_per_step
    assert display.callback_events[0] == "train_begin" and display.callback_events.count("step_end") == 2

    logs = [c[1] for c in display.calls if c[0] == "log_line"]
    assert len(logs) == 2 and all("loss" in line for line in logs)
    evals = [c[1] for c in display.calls if c[0] == "eval_line"]
    assert evals[0].startswith("eval before training:") and evals[-1].startswith("eval after training:")
    assert sum(line.startswith("eval step ") for line in evals) == 2
    assert set(names[5:]) == {"log_line", "eval_line"}  # nothing else after the trainer is built


@pytest.mark.slow
def test_the_quiet_default_prints_nothing(tiny_model_dir, tmp_path, capsys):
    cfg = _tiny_config(tiny_model_dir, tmp_path, 8)
    plan, data = T.check_run_inputs(cfg)
    capsys.readouterr()
    summary = T.run_training(cfg, plan, data)
    assert summary["status"] == "completed"
    assert capsys.readouterr().out == ""


def test_the_quiet_display_answers_every_call_of_the_protocol():
    quiet = T.QuietRunDisplay()
    protocol = {n for n in vars(T.RunDisplay) if not n.startswith("_")}
    assert protocol == {
        "probe_start",
        "probe",
        "run_header",
        "components",
        "progress",
        "log_line",
        "eval_line",
        "resuming",
        "interrupt",
        "tokenize_progress",
    }
    assert protocol <= {n for n in vars(T.QuietRunDisplay) if not n.startswith("_")}
    assert quiet.progress(None, 8) is None
