"""``cembed sweep``: trials at the scaled LR x each factor, the edge rule, sweep.json, the Optuna
study that lets a killed sweep resume with only the missing trials, and the refusals (exit 2)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

import cembed.train.sweep as S
from cembed.cli.app import app
from cembed.errors import UserError


def _config(tmp_path, tiny_model_dir, eval_section=True):
    rows = [{"anchor": f"question {i} about a car", "positive": f"answer {i} on the street"} for i in range(16)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "sts.tsv").write_text(
        "".join(f"a car on road {i}\ta vehicle on a street {i}\t{i % 5}\n" for i in range(8))
    )
    data = {
        "model": {"name_or_path": str(tiny_model_dir), "max_seq_length": 16, "device": "cpu"},
        "data": {"train": str(tmp_path / "pairs.jsonl"), "cache_dir": str(tmp_path / "cache")},
        "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
        "optim": {"learning_rate": 1e-3, "base_batch_size": 2, "lr_scaling": "sqrt"},
        "train": {"max_steps": 100, "logging_steps": 1, "output_dir": str(tmp_path / "run")},
    }
    if eval_section:
        data["eval"] = {"sts": str(tmp_path / "sts.tsv")}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _counting(monkeypatch, fail_on: int | None = None):
    """Count run_training calls (their learning rates); raise in call number ``fail_on``."""
    calls = []
    real = S.run_training

    def wrapper(cfg, plan, data, *args, **kwargs):
        calls.append(cfg.optim.learning_rate)
        if fail_on is not None and len(calls) == fail_on:
            raise KeyboardInterrupt  # killed mid-trial
        return real(cfg, plan, data, *args, **kwargs)

    monkeypatch.setattr(S, "run_training", wrapper)
    return calls


def _expected_trials(metrics: dict[float, float]) -> int:
    best = max(metrics, key=metrics.get)
    return 4 if best in (min(metrics), max(metrics)) else 3


@pytest.mark.slow
def test_sweep_trains_each_factor_and_picks_the_best(tmp_path, tiny_model_dir, monkeypatch):
    config = _config(tmp_path, tiny_model_dir)
    calls = _counting(monkeypatch)
    result = S.run_sweep(config, [0.5, 1.0, 2.0], steps=2, out=tmp_path / "sweep")
    path, plot = S.write_sweep(result)
    data = json.loads(path.read_text())

    # effective LR at x1: 1e-3 x sqrt(8/2) = 2e-3; each trial's config LR is 1e-3 x factor
    assert result.base_learning_rate == pytest.approx(2e-3)
    first = {t.factor: t for t in result.trials}
    assert first[0.5].learning_rate == pytest.approx(1e-3) and first[2.0].learning_rate == pytest.approx(4e-3)
    assert calls[:3] == pytest.approx([5e-4, 1e-3, 2e-3])
    assert data["metric"] == "sts_spearman_cosine"
    metrics = {t["factor"]: t["metric"] for t in data["trials"] if not t["edge"]}
    assert len(metrics) == 3
    assert len(data["trials"]) == _expected_trials(metrics) == len(calls)
    best = max(data["trials"], key=lambda t: t["metric"])
    assert data["best"]["factor"] == best["factor"]
    assert data["override"] == f"optim.learning_rate={best['config_learning_rate']:.6g}"
    for t in data["trials"]:  # each trial's metric is its own run's after-training score, at `steps` steps
        summary = json.loads((tmp_path / "sweep" / f"factor-{t['factor']:.6g}" / "run_summary.json").read_text())
        assert summary["steps"] == 2 and summary["eval"]["after"]["sts_spearman_cosine"] == t["metric"]
        assert summary["step_losses"][-1][1] == pytest.approx(t["last_loss"])
    assert plot is not None and plot.stat().st_size > 0

    # a rerun trains nothing: every trial is COMPLETE in the study
    again = S.run_sweep(config, [0.5, 1.0, 2.0], steps=2, out=tmp_path / "sweep")
    assert len(calls) == len(data["trials"]) and again.ran == []
    assert again.metric_before == data["metric_before_training"] is not None  # read back from the study
    assert again.best.factor == data["best"]["factor"]


@pytest.mark.slow
def test_a_killed_sweep_resumes_with_only_the_missing_trials(tmp_path, tiny_model_dir, monkeypatch):
    config = _config(tmp_path, tiny_model_dir)
    calls = _counting(monkeypatch, fail_on=2)
    with pytest.raises(KeyboardInterrupt):
        S.run_sweep(config, [0.5, 1.0, 2.0], steps=2, out=tmp_path / "sweep")
    assert len(calls) == 2

    import optuna

    study = optuna.load_study(study_name=S.STUDY_NAME, storage=f"sqlite:///{tmp_path / 'sweep' / 'study.db'}")
    states = sorted(t.state.name for t in study.trials)
    assert states == ["COMPLETE", "FAIL"]

    calls2 = _counting(monkeypatch)
    result = S.run_sweep(config, [0.5, 1.0, 2.0], steps=2, out=tmp_path / "sweep")
    metrics = {t.factor: t.metric for t in result.trials if not t.edge}
    # x0.5 was finished before the kill: only x1, x2 (and the edge factor if it fires) are trained
    assert calls2[:2] == pytest.approx([1e-3, 2e-3])
    assert len(calls2) == _expected_trials(metrics) - 1
    assert [t.trained_now for t in result.trials if t.factor == 0.5] == [False]


@pytest.mark.slow
def test_a_trial_left_running_by_a_kill_is_failed_and_trained_again(tmp_path, tiny_model_dir, monkeypatch):
    import optuna
    from optuna.distributions import FloatDistribution

    config = _config(tmp_path, tiny_model_dir)
    (tmp_path / "sweep").mkdir()
    storage = f"sqlite:///{tmp_path / 'sweep' / 'study.db'}"
    study = optuna.create_study(storage=storage, study_name=S.STUDY_NAME, direction="maximize")
    study.enqueue_trial({"factor": 1.0})
    study.ask({"factor": FloatDistribution(1e-6, 1e6, log=True)})  # RUNNING, its process gone
    calls = _counting(monkeypatch)
    S.run_sweep(config, [1.0, 2.0], steps=1, out=tmp_path / "sweep")
    assert calls[0] == pytest.approx(1e-3)
    states = [t.state.name for t in optuna.load_study(study_name=S.STUDY_NAME, storage=storage).trials]
    assert states[0] == "FAIL" and "RUNNING" not in states


@pytest.mark.parametrize("text", ["", " , ", "0.5,0,2", "1,-2", "1,abc", "nan"])
def test_bad_factors_are_refused_naming_the_flag(text):
    with pytest.raises(UserError, match="--lr-factors"):
        S.parse_factors(text)


def test_factors_are_sorted_and_distinct():
    assert S.parse_factors("2, 0.5,1,2") == [0.5, 1.0, 2.0]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--lr-factors", ""], "--lr-factors"),
        (["--lr-factors", "0.5,-1"], "--lr-factors"),
        (["--metric", "sts_nope"], "--metric"),
    ],
)
def test_cli_refuses_bad_flags_with_exit_2(tmp_path, tiny_model_dir, args, needle):
    config = _config(tmp_path, tiny_model_dir)
    res = CliRunner().invoke(app, ["sweep", str(config), *args])
    assert res.exit_code == 2, res.output
    assert needle in res.output and "Traceback" not in res.output
    assert not (tmp_path / "run-lr-sweep").exists()  # refused before any trial


def test_cli_refuses_a_config_without_eval_sets(tmp_path, tiny_model_dir):
    config = _config(tmp_path, tiny_model_dir, eval_section=False)
    res = CliRunner().invoke(app, ["sweep", str(config)])
    assert res.exit_code == 2
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "eval" in lines[0] and "no eval sets" in lines[0]


@pytest.mark.slow
def test_cli_prints_the_table_and_the_override(tmp_path, tiny_model_dir):
    config = _config(tmp_path, tiny_model_dir)
    res = CliRunner().invoke(
        app, ["sweep", str(config), "--lr-factors", "1,2", "--steps", "1", "--out", str(tmp_path / "s")]
    )
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "s" / "sweep.json").read_text())
    assert data["override"] in res.output and "loss at end" in res.output
    assert (tmp_path / "s" / "sweep.png").exists()


def test_cli_an_interrupted_trial_says_how_to_resume(tmp_path, tiny_model_dir, monkeypatch):
    import signal

    from cembed.errors import RunInterrupted

    def stopped(*args, **kwargs):
        raise RunInterrupted(signal.SIGTERM, 1, None)

    monkeypatch.setattr(S, "run_training", stopped)
    config = _config(tmp_path, tiny_model_dir)
    res = CliRunner().invoke(app, ["sweep", str(config), "--steps", "1", "--out", str(tmp_path / "s")])
    assert res.exit_code == 143 and "rerun the same command" in res.output and "Traceback" not in res.output


def test_trials_carry_the_unplaceable_row_warnings_train_would_show(tmp_path, tiny_model_dir, monkeypatch):
    """Each trial is checked as ``cembed train`` checks it: the rows the no-duplicates sampler cannot
    place are handed to its run, kept in its record (sweep.json, the study) and printed once."""
    config = _config(tmp_path, tiny_model_dir)
    # 16 rows, 4 of them sharing one positive: a duplicate-free batch of 8 holds one of those, so one
    # batch is built and the other 8 rows are left out
    rows = [{"anchor": f"question {i}", "positive": "a shared answer" if i < 4 else f"answer {i}"} for i in range(16)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    handed = []

    def fake_run(cfg, plan, data, *args, warnings=(), **kwargs):  # the trial's run, without training
        handed.append(warnings)
        return {"step_losses": [[1, 0.5]], "eval": {"before": None, "after": {"sts_spearman_cosine": 0.5}}}

    monkeypatch.setattr(S, "run_training", fake_run)
    res = CliRunner().invoke(
        app, ["sweep", str(config), "--lr-factors", "1", "--steps", "1", "--out", str(tmp_path / "s")]
    )
    assert res.exit_code == 0, res.output
    (warning,) = handed[0]
    assert warning.startswith("8 of 16 rows cannot be placed in a duplicate-free batch of 8 (1 batches per epoch)")
    data = json.loads((tmp_path / "s" / "sweep.json").read_text())
    assert [t["warnings"] for t in data["trials"]] == [[warning]] and data["warnings"] == [warning]
    assert res.output.count("warning: 8 of 16 rows cannot be placed") == 1
    again = S.run_sweep(config, [1.0], steps=1, out=tmp_path / "s")  # read back from the study
    assert len(handed) == 1 and again.trials[0].trained_now is False and again.trials[0].warnings == [warning]


# --- issue 32 item 3: a stored trial is reused only by the config that trained it ----------------------


def _fake_runs(monkeypatch):
    """Replace each trial's training by a summary whose metric is its LR (no model is trained);
    returns the LRs of the runs, in call order."""
    calls = []

    def fake_run(cfg, plan, data, *args, **kwargs):
        calls.append(plan.learning_rate)
        return {
            "step_losses": [[1, 0.5]],
            "eval": {"before": None, "after": {"sts_spearman_cosine": plan.learning_rate}},
        }

    monkeypatch.setattr(S, "run_training", fake_run)
    return calls


def test_a_changed_config_is_refused_naming_the_field(tmp_path, tiny_model_dir, monkeypatch):
    config, out = _config(tmp_path, tiny_model_dir), tmp_path / "s"
    calls = _fake_runs(monkeypatch)
    S.run_sweep(config, [1.0], steps=1, out=out)
    assert len(calls) == 1
    again = S.run_sweep(config, [1.0], steps=1, out=out)  # unchanged: read back, nothing trained
    assert len(calls) == 1 and again.ran == [] and again.trials[0].trained_now is False
    batch16 = ["batch.per_device_train_batch_size=16"]
    with pytest.raises(UserError) as err:
        S.run_sweep(config, [1.0], steps=1, out=out, overrides=batch16)
    assert str(err.value) == (
        f"sweep: {out / 'study.db'} was run with batch.per_device_train_batch_size=8, this config has 16; "
        "use a new --out or --overwrite to move the old study aside"
    )
    with pytest.raises(UserError, match=r"was run with --steps=1, this config has 2"):
        S.run_sweep(config, [1.0], steps=2, out=out)
    with pytest.raises(UserError, match=r"was run with optim.learning_rate=0.001, this config has 0.002"):
        S.run_sweep(config, [1.0], steps=1, out=out, overrides=["optim.learning_rate=0.002"])
    assert len(calls) == 1  # refused before any training


def test_an_edit_in_place_of_the_training_file_is_refused_naming_the_data(tmp_path, tiny_model_dir, monkeypatch):
    """Issue 39: the same config over a training file edited in place (same path, same row count) is
    another sweep: refused naming the file, then trained afresh with --overwrite (it was read back)."""
    config, out = _config(tmp_path, tiny_model_dir), tmp_path / "s"
    calls = _fake_runs(monkeypatch)
    S.run_sweep(config, [1.0], steps=1, out=out)
    pairs = tmp_path / "pairs.jsonl"
    lines = pairs.read_text().splitlines()
    lines[7] = json.dumps({"anchor": "question 7 about a boat", "positive": "answer 7 on the street"})
    pairs.write_text("\n".join(lines) + "\n")  # one cell of one row edited
    with pytest.raises(UserError) as err:
        S.run_sweep(config, [1.0], steps=1, out=out)
    assert re.fullmatch(
        rf"sweep: {re.escape(str(out / 'study.db'))} was run on other data: data.train \({re.escape(str(pairs))}\) "
        r"held 16 rows \(xxh3 [0-9a-f]{8}\) and holds 16 rows \(xxh3 [0-9a-f]{8}\) now \(edited in place\?\): its "
        r"trials scored the old rows; use a new --out or --overwrite to move the old study aside",
        str(err.value),
    ), str(err.value)
    assert len(calls) == 1  # refused before any training
    fresh = S.run_sweep(config, [1.0], steps=1, out=out, overwrite=True)
    assert fresh.ran == [1.0] and len(calls) == 2


def test_an_edit_in_place_of_an_eval_set_is_refused_naming_it(tmp_path, tiny_model_dir, monkeypatch):
    """The eval sets are the score: an edit of one gold score is another sweep's trials."""
    config, out = _config(tmp_path, tiny_model_dir), tmp_path / "s"
    calls = _fake_runs(monkeypatch)
    S.run_sweep(config, [1.0], steps=1, out=out)
    sts = tmp_path / "sts.tsv"
    sts.write_text(sts.read_text().replace("street 3\t3", "street 3\t0"))
    with pytest.raises(UserError, match=rf"was run on other data: eval.sts.sts \({re.escape(str(sts))}\) held 8 pairs"):
        S.run_sweep(config, [1.0], steps=1, out=out)
    assert len(calls) == 1


def test_fields_that_change_neither_trials_nor_scores_reuse_the_trials(tmp_path, tiny_model_dir, monkeypatch):
    """Issue 39: data.num_proc, train.peak_tflops, workers, logging are not what a trial trains: the
    trials are read back; batch.gradient_accumulation_steps and model.save_dtype (the model is scored
    as saved) are, and are refused."""
    config, out = _config(tmp_path, tiny_model_dir), tmp_path / "s"
    calls = _fake_runs(monkeypatch)
    S.run_sweep(config, [1.0], steps=1, out=out)
    safe = ["data.num_proc=2", "train.peak_tflops=100", "train.dataloader_num_workers=3", "train.logging_steps=7"]
    again = S.run_sweep(config, [1.0], steps=1, out=out, overrides=safe)
    assert again.ran == [] and len(calls) == 1
    for change, shown in [
        ("batch.gradient_accumulation_steps=2", "batch.gradient_accumulation_steps=1, this config has 2"),
        ("model.save_dtype=bf16", "model.save_dtype=unset, this config has bf16"),
        ("train.nonfinite_loss=skip", "train.nonfinite_loss=stop, this config has skip"),
    ]:
        with pytest.raises(UserError, match=re.escape(f"was run with {shown};")):
            S.run_sweep(config, [1.0], steps=1, out=out, overrides=[change])
    assert len(calls) == 1


def test_overwrite_moves_the_old_study_aside_and_trains_fresh(tmp_path, tiny_model_dir, monkeypatch):
    import optuna

    config, out = _config(tmp_path, tiny_model_dir), tmp_path / "s"
    calls = _fake_runs(monkeypatch)
    first = S.run_sweep(config, [1.0], steps=1, out=out)
    S.write_sweep(first)
    fresh = S.run_sweep(
        config, [1.0], steps=1, out=out, overrides=["batch.per_device_train_batch_size=16"], overwrite=True
    )
    # trained again at the new batch's LR: 1e-3 x sqrt(16/2), not read back at sqrt(8/2)'s
    assert calls == pytest.approx([2e-3, 1e-3 * 8**0.5]) and fresh.ran == [1.0]
    assert fresh.trials[0].learning_rate == pytest.approx(fresh.base_learning_rate) == pytest.approx(1e-3 * 8**0.5)
    (aside,) = out.glob("study-*")
    assert fresh.moved_aside == aside and (aside / "sweep.json").is_file()
    old = optuna.load_study(study_name=S.STUDY_NAME, storage=f"sqlite:///{aside / 'study.db'}")
    assert [t.state.name for t in old.trials] == ["COMPLETE"] and old.trials[0].value == pytest.approx(2e-3)
    new = optuna.load_study(study_name=S.STUDY_NAME, storage=f"sqlite:///{out / 'study.db'}")
    assert [t.value for t in new.trials] == pytest.approx([1e-3 * 8**0.5])


def test_a_study_without_a_config_record_is_refused(tmp_path, tiny_model_dir, monkeypatch):
    """A study whose finished trials carry no record of what they trained (an older cembed) is not
    read back as this config's."""
    import optuna
    from optuna.distributions import FloatDistribution

    config, out = _config(tmp_path, tiny_model_dir), tmp_path / "s"
    out.mkdir()
    study = optuna.create_study(storage=f"sqlite:///{out / 'study.db'}", study_name=S.STUDY_NAME, direction="maximize")
    study.enqueue_trial({"factor": 1.0})
    study.tell(study.ask({"factor": FloatDistribution(1e-6, 1e6, log=True)}), 0.5)
    calls = _fake_runs(monkeypatch)
    with pytest.raises(UserError, match=r"holds trials without a record of the config they ran.*--overwrite"):
        S.run_sweep(config, [1.0], steps=1, out=out)
    assert calls == []


@pytest.mark.slow
def test_cli_a_changed_batch_is_refused_then_overwritten_then_reused(tmp_path, tiny_model_dir, monkeypatch):
    config, out = _config(tmp_path, tiny_model_dir), tmp_path / "s"
    calls = _counting(monkeypatch)
    sweep = ["sweep", str(config), "--lr-factors", "1", "--steps", "1", "--out", str(out)]
    assert CliRunner().invoke(app, sweep).exit_code == 0 and len(calls) == 1

    changed = [*sweep, "batch.per_device_train_batch_size=16"]
    res = CliRunner().invoke(app, changed)
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    (line,) = [x for x in res.output.splitlines() if x.strip()]
    assert "batch.per_device_train_batch_size=8, this config has 16" in line and len(calls) == 1

    res = CliRunner().invoke(app, [*changed, "--overwrite"])
    assert res.exit_code == 0 and len(calls) == 2, res.output
    assert "moved the old sweep aside to" in res.output and len(list(out.glob("study-*/study.db"))) == 1
    # the header's effective LR at x1 is the table's x1 row and the best line's: 1e-3 x sqrt(16/2)
    assert "effective learning_rate at x1: 2.828e-03" in res.output
    (row,) = [x for x in res.output.splitlines() if x.startswith("│") and "x1" in x]
    assert [cell.strip() for cell in row.split("│")[1:3]] == ["x1", "2.828e-03"]
    assert "best: x1 = effective LR 2.828e-03" in res.output

    res = CliRunner().invoke(app, changed)  # unchanged since: read back, nothing trained
    assert res.exit_code == 0 and len(calls) == 2 and "finished before, read back" in res.output, res.output


# --- sweep.json and sweep.png from a result built by hand (no training) -------------------------------


def _result(tmp_path, metric_before: float | None = 0.25) -> S.SweepResult:
    trials = [
        S.SweepTrial(0.5, 1e-3, 5e-4, 0.5, 0.75, "f-0.5", True, warnings=["w1"]),
        S.SweepTrial(1.0, 2e-3, 1e-3, 0.625, None, "f-1", False, warnings=["w1", "w2"]),
        S.SweepTrial(2.0, 4e-3, 2e-3, 0.375, 1.5, "f-2", True),
    ]
    return S.SweepResult(
        metric="sts_spearman_cosine",
        greater_is_better=True,
        base_learning_rate=2e-3,
        base_config_learning_rate=1e-3,
        lr_derivation="sqrt rule",
        steps=3,
        trials=trials,
        best=trials[1],
        out=tmp_path,
        metric_before=metric_before,
        storage="sqlite:///study.db",
        ran=[0.5, 2.0],
    )


def test_sweep_json_holds_every_trial_the_best_and_the_override(tmp_path):
    result = _result(tmp_path)
    path, plot = S.write_sweep(result)
    assert path == tmp_path / "sweep.json" and plot == tmp_path / "sweep.png"
    trial = {"learning_rate": 2e-3, "config_learning_rate": 1e-3, "metric": 0.625, "last_loss": None}
    best = {"factor": 1.0, **trial, "output_dir": "f-1", "trained_now": False, "edge": False, "warnings": ["w1", "w2"]}
    data = json.loads(path.read_text())
    assert data == {
        "metric": "sts_spearman_cosine",
        "greater_is_better": True,
        "metric_before_training": 0.25,
        "steps": 3,
        "base_learning_rate": 2e-3,
        "base_config_learning_rate": 1e-3,
        "lr_derivation": "sqrt rule",
        "trials": [
            {"factor": 0.5, "learning_rate": 1e-3, "config_learning_rate": 5e-4, "metric": 0.5, "last_loss": 0.75,
             "output_dir": "f-0.5", "trained_now": True, "edge": False, "warnings": ["w1"]},
            best,
            {"factor": 2.0, "learning_rate": 4e-3, "config_learning_rate": 2e-3, "metric": 0.375, "last_loss": 1.5,
             "output_dir": "f-2", "trained_now": True, "edge": False, "warnings": []},
        ],
        "best": best,
        "override": "optim.learning_rate=0.001",
        "warnings": ["w1", "w2"],
        "study": {"storage": "sqlite:///study.db", "name": "lr-sweep"},
        "trained_this_call": [0.5, 2.0],
        "moved_aside": None,
        "plot": str(tmp_path / "sweep.png"),
    }  # fmt: skip
    result.moved_aside = tmp_path / "study-1"
    assert result.as_json()["moved_aside"] == str(tmp_path / "study-1")


def _plotted(tmp_path, monkeypatch, result):
    """Plot ``result``; returns (figure, axes, the PNG's width and height in pixels)."""
    import struct

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.setitem(matplotlib.rcParams, "savefig.dpi", 50)  # a user's matplotlibrc: the plot keeps its 100
    made = []
    real = plt.subplots

    def subplots(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(plt, "subplots", subplots)
    path = S.plot_sweep(result, str(tmp_path / "plot.png"))
    assert path == tmp_path / "plot.png"
    ((fig, ax),) = made
    assert not plt.fignum_exists(fig.number)  # closed
    width, height = struct.unpack(">II", path.read_bytes()[16:24])  # the PNG's IHDR
    return fig, ax, (width, height)


def test_the_plot_marks_each_factor_the_best_and_the_base_models_metric(tmp_path, monkeypatch):
    from matplotlib.font_manager import FontProperties

    fig, ax, size = _plotted(tmp_path, monkeypatch, _result(tmp_path))
    assert size == (600, 400) and list(fig.get_size_inches()) == [6, 4]
    after, best, before = ax.get_lines()
    assert list(after.get_xdata()) == [1e-3, 2e-3, 4e-3] and list(after.get_ydata()) == [0.5, 0.625, 0.375]
    assert (after.get_marker(), after.get_color(), after.get_label()) == ("o", "tab:blue", "after training")
    assert list(best.get_xdata()) == [2e-3] and list(best.get_ydata()) == [0.625]
    assert (best.get_marker(), best.get_linestyle(), best.get_color()) == ("*", "None", "tab:red")
    assert (best.get_markersize(), best.get_label()) == (14, "best")
    assert list(before.get_ydata()) == [0.25, 0.25]
    assert (before.get_color(), before.get_linestyle(), before.get_label()) == ("gray", "--", "before training")
    notes = [(t.get_text(), t.xy, t.xyann, t.anncoords) for t in ax.texts]
    assert notes == [
        ("x0.5", (1e-3, 0.5), (0, 6), "offset points"),
        ("x1", (2e-3, 0.625), (0, 6), "offset points"),
        ("x2", (4e-3, 0.375), (0, 6), "offset points"),
    ]
    assert ax.get_xscale() == "log" and ax.margins() == (0.08, 0.15)
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("effective learning rate", "sts_spearman_cosine")
    assert ax.get_title() == "LR sweep: 3 steps per trial"
    legend = [(t.get_text(), t.get_fontsize()) for t in ax.get_legend().get_texts()]
    small = FontProperties(size="small").get_size_in_points()
    assert legend == [("after training", small), ("best", small), ("before training", small)]


def test_the_plot_without_a_base_metric_has_no_line_for_it_and_no_trials_no_plot(tmp_path, monkeypatch):
    _, ax, _ = _plotted(tmp_path, monkeypatch, _result(tmp_path, metric_before=None))
    assert [line.get_label() for line in ax.get_lines()] == ["after training", "best"]
    empty = _result(tmp_path)
    empty.trials = []
    assert S.plot_sweep(empty, tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()


def test_a_sweep_without_trials_writes_no_plot(tmp_path):
    result = _result(tmp_path)
    result.trials = []
    path, plot = S.write_sweep(result)
    assert plot is None and json.loads(path.read_text())["plot"] is None and not (tmp_path / "sweep.png").exists()


def test_a_changed_record_names_each_field_its_old_and_new_value(tmp_path):
    import optuna

    study = optuna.create_study(study_name=S.STUDY_NAME)  # in memory
    old = {"batch.size": 8, "data.train": "a.jsonl", "model.prompts": ["q: "], "gone": 1}
    S.check_study_record(study, old, tmp_path / "study.db")  # a new study stores the record
    assert study.user_attrs == {"record": old, "fingerprint": S.record_fingerprint(old)}
    S.check_study_record(study, dict(old), tmp_path / "study.db")  # the same record passes
    new = {"batch.size": 16, "data.train": "b.jsonl", "model.prompts": ["q: "], "added": None, "new": 2}
    assert S.record_differences(old, new) == [
        ("batch.size", 8, 16), ("data.train", "a.jsonl", "b.jsonl"), ("gone", 1, None), ("new", None, 2)
    ]  # fmt: skip
    with pytest.raises(UserError) as err:
        S.check_study_record(study, new, tmp_path / "study.db")
    assert str(err.value) == (
        f"sweep: {tmp_path / 'study.db'} was run with batch.size=8, data.train=a.jsonl, gone=1, new=unset, "
        "this config has batch.size=16, data.train=b.jsonl, gone=unset, new=2; "
        "use a new --out or --overwrite to move the old study aside"
    )
    with pytest.raises(UserError) as err:
        S.check_study_record(study, {**old, "batch.size": 16, "gone": 2}, tmp_path / "study.db")
    assert "was run with batch.size=8, gone=1, this config has batch.size=16, gone=2; use" in str(err.value)
    with pytest.raises(UserError) as err:
        S.check_study_record(study, {**old, "model.prompts": ["p: "]}, tmp_path / "study.db")
    assert 'was run with model.prompts=["q: "], this config has ["p: "]; use a new' in str(err.value)


def test_overwrite_moves_each_earlier_study_into_its_own_folder(tmp_path, monkeypatch):
    out = tmp_path / "s"
    out.mkdir()
    assert S.move_study_aside(out) is None  # no study: nothing moved
    monkeypatch.setattr(S.time, "strftime", lambda fmt: {"%Y%m%d-%H%M%S": "20260102-030405"}[fmt])
    for n in range(3):  # three overwrites within one second
        for name in ("study.db", "sweep.json", "factor-1", "factor-0.5", "notes.txt"):
            (out / name).write_text(str(n))
        aside = S.move_study_aside(out)
        assert aside == out / ("study-20260102-030405" + ("" if n == 0 else f"-{n}"))
        assert sorted(p.name for p in aside.iterdir()) == ["factor-0.5", "factor-1", "study.db", "sweep.json"]
        assert (aside / "study.db").read_text() == str(n)
    assert sorted(p.name for p in out.iterdir()) == [
        "notes.txt", "study-20260102-030405", "study-20260102-030405-1", "study-20260102-030405-2"
    ]  # fmt: skip


def test_bad_factors_are_refused_with_the_whole_fix():
    for text in (None, "", " , "):
        with pytest.raises(UserError) as err:
            S.parse_factors(text)
        assert str(err.value) == (
            "--lr-factors is empty; give comma-separated positive factors, e.g. --lr-factors 0.5,1,2"
        )
    with pytest.raises(UserError) as err:
        S.parse_factors("1, abc")
    assert str(err.value) == "--lr-factors: 'abc' is not a number; e.g. --lr-factors 0.5,1,2"
    for bad in ("0", "-2", "inf", "nan"):
        with pytest.raises(UserError) as err:
            S.parse_factors(f"1,{bad}")
        assert str(err.value) == f"--lr-factors: {bad} is not a positive factor; e.g. --lr-factors 0.5,1,2"


def test_a_trial_is_stored_with_what_completed_trials_reads_back(tmp_path):
    import optuna
    from optuna.distributions import FloatDistribution

    assert S._space() == {"factor": FloatDistribution(1e-6, 1e6, log=True)}
    study = optuna.create_study(study_name=S.STUDY_NAME, direction="maximize")  # in memory
    trial_at = {}
    for factor, steps, fingerprint in ((4.0, 5, "f"), (2.0, 3, "f"), (8.0, 3, "other"), (0.5, 3, "f")):
        study.enqueue_trial({"factor": factor})
        trial = study.ask(S._space())
        result = S.SweepTrial(factor, 1e-3 * factor, 5e-4 * factor, 0.1 * factor, 0.5, f"f-{factor:g}", True,
                              edge=factor == 2.0, warnings=["w"])  # fmt: skip
        S.record_trial(study, trial, result, "sts", steps, fingerprint)
        trial_at[factor] = trial.number
    study.enqueue_trial({"factor": 1.0})  # an older cembed's trial: no edge, no warnings stored
    older = study.ask(S._space())
    for name, value in {"learning_rate": 1e-3, "config_learning_rate": 5e-4, "output_dir": "f-1"}.items():
        older.set_user_attr(name, value)
    for name, value in {"metric_name": "sts", "steps": 3, "fingerprint": "f"}.items():
        older.set_user_attr(name, value)
    study.tell(older, 0.125)
    study.enqueue_trial({"factor": 16.0})  # killed after its attributes were stored, before its score
    killed = study.ask(S._space())
    for name, value in study.trials[trial_at[2.0]].user_attrs.items():
        killed.set_user_attr(name, value)
    study.tell(killed, state=optuna.trial.TrialState.FAIL)
    stored = study.trials[trial_at[2.0]]
    assert stored.value == pytest.approx(0.2) and stored.params == {"factor": 2.0}
    assert stored.user_attrs == {
        "learning_rate": 2e-3, "config_learning_rate": 1e-3, "last_loss": 0.5, "output_dir": "f-2", "edge": True,
        "warnings": ["w"], "metric_name": "sts", "steps": 3, "fingerprint": "f",
    }  # fmt: skip
    done = S.completed_trials(study, "sts", 3, "f")  # not the trial of 5 steps, nor another config's
    assert done == {
        "2": S.SweepTrial(2.0, 2e-3, 1e-3, pytest.approx(0.2), 0.5, "f-2", False, edge=True, warnings=["w"]),
        "0.5": S.SweepTrial(0.5, 5e-4, 2.5e-4, pytest.approx(0.05), 0.5, "f-0.5", False, warnings=["w"]),
        "1": S.SweepTrial(1.0, 1e-3, 5e-4, 0.125, None, "f-1", False, edge=False, warnings=[]),
    }
    assert S.completed_trials(study, "other", 3, "f") == {}


def test_the_record_fingerprint_is_sha256_of_its_sorted_json():
    import hashlib
    from pathlib import Path

    record = {"b": 1, "a": Path("x")}
    expected = hashlib.sha256(b'{"a": "x", "b": 1}').hexdigest()[:16]
    assert S.record_fingerprint(record) == expected


def test_the_sweep_metric_and_its_refusals(tmp_path):
    from cembed.config.file import load_config

    cfg = load_config(_config(tmp_path, "some-model"))  # no model is read
    assert S.sweep_metric(cfg, None) == ("sts_spearman_cosine", True)
    assert S.sweep_metric(cfg, "eval_sts_pearson_cosine") == ("sts_pearson_cosine", True)
    assert S.sweep_metric(cfg, "sts_pearson_cosine") == ("sts_pearson_cosine", True)
    with pytest.raises(UserError) as err:
        S.sweep_metric(cfg, "eval_sts_nope")
    assert str(err.value) == (
        "--metric: 'eval_sts_nope' is not a metric of the eval sets (e.g. sts_spearman_cosine, sts_pearson_cosine)"
    )
    cfg = load_config(
        _config(tmp_path, "some-model"), ["eval.metric_for_best_model=sts_pearson_cosine", "eval.eval_steps=10"]
    )
    assert S.sweep_metric(cfg, None) == ("sts_pearson_cosine", True)
    cfg = load_config(_config(tmp_path, "some-model"), ["eval.greater_is_better=false"])
    assert S.sweep_metric(cfg, None) == ("sts_spearman_cosine", False)
    cfg = load_config(_config(tmp_path, "some-model", eval_section=False))
    with pytest.raises(UserError) as err:
        S.sweep_metric(cfg, None)
    assert str(err.value) == (
        "eval: the config has no eval sets; sweep scores each trial on them: add an eval section "
        "(eval.retrieval or eval.sts)"
    )


def test_a_trials_overrides_and_the_record_of_what_it_trains(tmp_path):
    from cembed.config.file import load_config

    assert S.trial_overrides(0.002, 5, tmp_path / "factor-2") == [
        "optim.learning_rate=0.002",
        "train.num_train_epochs=null",
        "train.max_steps=5",
        f"train.output_dir={(tmp_path / 'factor-2').resolve()}",
        "train.save_steps=null",
        "train.push_to_hub=false",
        "train.report_to=[none]",
        "eval.eval_steps=null",
        "eval.metric_for_best_model=null",
    ]
    config = _config(tmp_path, "some-model")
    record = S.sweep_record(load_config(config), "fp32", 2)
    assert record["model.precision"] == "fp32" and record["--steps"] == 2 and record["optim.learning_rate"] == 1e-3
    assert record["eval.sts"] == [{"path": str(tmp_path / "sts.tsv"), "name": None}]
    assert record["model.name_or_path"] == "some-model" and record["batch.per_device_train_batch_size"] == 8
    for left_out in ("train.output_dir", "train.max_steps", "data.cache_dir", "model.device", "train.logging_steps"):
        assert left_out not in record
    assert not [key for key in record if key.startswith(("distributed", "eval.batch_size", "eval.eval_steps"))]
    # where and how a trial logs, saves and runs do not change the record; what it trains does
    moved = load_config(config, ["train.output_dir=elsewhere", "data.cache_dir=c2", "train.logging_steps=5"])
    assert S.sweep_record(moved, "fp32", 2) == record
    seeded = S.sweep_record(load_config(config, ["train.seed=7"]), "fp32", 2)
    assert S.record_differences(record, seeded) == [("train.seed", 42, 7)]


def test_the_study_is_created_then_loaded_and_a_running_trial_marked_failed(tmp_path):
    import optuna

    storage = f"sqlite:///{tmp_path / 'study.db'}"
    study = S.open_study(storage, greater=False)
    assert study.study_name == "lr-sweep" and study.direction == optuna.study.StudyDirection.MINIMIZE
    study.enqueue_trial({"factor": 1.0})
    study.ask(S._space())  # left RUNNING by a killed sweep
    again = S.open_study(storage, greater=False)
    assert [t.state for t in again.trials] == [optuna.trial.TrialState.FAIL]
    assert S.open_study(f"sqlite:///{tmp_path / 'up.db'}", greater=True).direction.name == "MAXIMIZE"
    assert optuna.logging.get_verbosity() == optuna.logging.WARNING
    record = {"a": 1}
    study, url, fingerprint, moved = S.sweep_study(tmp_path, True, record, overwrite=False)
    assert url == storage and fingerprint == S.record_fingerprint(record) and moved is None
    assert study.user_attrs["record"] == record
    study, url, fingerprint, moved = S.sweep_study(tmp_path, True, {"a": 2}, overwrite=True)
    assert moved is not None and (moved / "study.db").is_file() and study.user_attrs["record"] == {"a": 2}


def test_a_study_with_finished_trials_and_no_record_is_refused_failed_ones_are_not(tmp_path):
    import optuna

    failed = optuna.create_study(study_name=S.STUDY_NAME)  # in memory
    failed.enqueue_trial({"factor": 1.0})
    failed.tell(failed.ask(S._space()), state=optuna.trial.TrialState.FAIL)
    S.check_study_record(failed, {"a": 1}, tmp_path / "study.db")  # nothing finished: the record is stored
    assert failed.user_attrs["record"] == {"a": 1}
    done = optuna.create_study(study_name=S.STUDY_NAME)
    done.enqueue_trial({"factor": 1.0})
    done.tell(done.ask(S._space()), 0.5)
    with pytest.raises(UserError) as err:
        S.check_study_record(done, {"a": 1}, tmp_path / "study.db")
    assert str(err.value) == (
        f"sweep: {tmp_path / 'study.db'} holds trials without a record of the config they ran; "
        "use a new --out or --overwrite to move the old study aside"
    )


def test_run_sweep_refuses_bad_steps_and_factors_before_reading_the_config(tmp_path):
    missing = tmp_path / "nope.yaml"
    for steps, factors, says in (
        (0, [1.0], "--steps must be at least 1 (got 0)"),
        (1, [], "--lr-factors is empty; e.g. 0.5,1,2"),
        (-1, [], "--steps must be at least 1 (got -1)"),
    ):
        with pytest.raises(UserError) as err:
            S.run_sweep(missing, factors, steps)
        assert str(err.value) == says


def test_run_sweep_extends_past_the_best_edge_and_records_each_trial(tmp_path, tiny_model_dir, monkeypatch):
    """Without training (the run returns a summary): the metric chosen, one factor beyond the best edge
    (x2 above, x0.5 below, none when the best is inside), the last loss, the base model's score, the
    default folder, and the events a caller is told."""
    import optuna

    def fake_run(cfg, plan, data, *args, **kwargs):
        assert data is not None  # the trial's checked data
        lr = cfg.optim.learning_rate  # the config LR: 1e-3 x factor
        losses = [[1, 0.5], [2, lr]] if lr != 2e-3 else []
        after = {"sts_pearson_cosine": lr, "sts_spearman_cosine": -abs(lr - 2e-3)}  # peak at x2
        before = {"sts_pearson_cosine": 0.125, "sts_spearman_cosine": 0.25}
        return {"step_losses": losses, "last_loss": 0.75, "eval": {"before": before, "after": after}}

    monkeypatch.setattr(S, "run_training", fake_run)
    config = _config(tmp_path, tiny_model_dir)
    (tmp_path / "up" / "factor-2").mkdir(parents=True)
    (tmp_path / "up" / "factor-2" / "half-written").write_text("")  # a killed trial's run
    events = []
    on_trial = lambda event, factor, lr: events.append((event, factor, round(lr, 9)))  # noqa: E731
    up = S.run_sweep(config, [1.0, 2.0], 1, out=tmp_path / "up", metric="eval_sts_pearson_cosine", on_trial=on_trial)
    assert up.metric == "sts_pearson_cosine" and up.greater_is_better
    assert [(t.factor, t.edge, t.metric) for t in up.trials] == [
        (1.0, False, 1e-3),
        (2.0, False, 2e-3),
        (4.0, True, 4e-3),
    ]
    assert up.best.factor == 4.0 and up.ran == [1.0, 2.0, 4.0] and up.metric_before == 0.125
    assert [(t.output_dir, t.trained_now) for t in up.trials] == [
        (str(tmp_path / "up" / f"factor-{f}"), True) for f in (1, 2, 4)
    ]
    assert (up.base_config_learning_rate, up.steps, up.lr_derivation) == (
        1e-3,
        1,
        "2.000e-03 = 0.001 x sqrt(8/2) (lr_scaling: sqrt)",
    )
    assert not (tmp_path / "up" / "factor-2" / "half-written").exists()  # its trial starts over
    assert [t.last_loss for t in up.trials] == [1e-3, 0.75, 4e-3]  # the last step's loss, else the summary's
    assert events == [
        ("start", 1.0, 2e-3), ("done", 1.0, 2e-3), ("start", 2.0, 4e-3), ("done", 2.0, 4e-3),
        ("start", 4.0, 8e-3), ("done", 4.0, 8e-3),
    ]  # fmt: skip
    study = optuna.load_study(study_name=S.STUDY_NAME, storage=up.storage)
    assert study.direction.name == "MAXIMIZE"
    assert {t.user_attrs["fingerprint"] for t in study.trials} == {study.user_attrs["fingerprint"]}
    events.clear()
    again = S.run_sweep(config, [1.0, 2.0], 1, out=tmp_path / "up", metric="sts_pearson_cosine", on_trial=on_trial)
    assert again.ran == [] and again.metric_before == 0.125
    assert events == [("cached", 1.0, 2e-3), ("cached", 2.0, 4e-3), ("cached", 4.0, 8e-3)]

    down = S.run_sweep(config, [4.0, 8.0], 1, out=tmp_path / "down")  # spearman: best at x4, the low edge
    assert [(t.factor, t.edge) for t in down.trials] == [(2.0, True), (4.0, False), (8.0, False)]
    assert down.best.factor == 2.0 and down.metric == "sts_spearman_cosine" and down.metric_before == 0.25
    inside = S.run_sweep(config, [1.0, 2.0, 4.0], 1, out=tmp_path / "inside")
    assert [t.factor for t in inside.trials] == [1.0, 2.0, 4.0] and inside.best.factor == 2.0
    three = S.run_sweep(config, [0.5, 1.0, 2.0], 1, out=tmp_path / "a" / "three", metric="sts_pearson_cosine")
    assert [(t.factor, t.edge) for t in three.trials] == [(0.5, False), (1.0, False), (2.0, False), (4.0, True)]
    lower = ["eval.greater_is_better=false"]  # the least pearson is the best: x0.5, then x0.25 below it
    least = S.run_sweep(config, [0.5, 1.0], 1, out=tmp_path / "least", metric="sts_pearson_cosine", overrides=lower)
    assert least.best.factor == 0.25 and not least.greater_is_better
    study = optuna.load_study(study_name=S.STUDY_NAME, storage=least.storage)
    assert study.direction.name == "MINIMIZE" and study.user_attrs["record"]["model.precision"] == "fp32"
    alone = S.run_sweep(config, [1.0], 1, overrides=[f"train.output_dir={tmp_path / 'run'}/"])
    assert alone.out == Path(f"{tmp_path / 'run'}-lr-sweep") and [t.factor for t in alone.trials] == [1.0]


def test_a_trial_killed_mid_run_is_marked_failed(tmp_path, tiny_model_dir, monkeypatch):
    import optuna

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(S, "run_training", killed)
    with pytest.raises(KeyboardInterrupt):
        S.run_sweep(_config(tmp_path, tiny_model_dir), [1.0], 1, out=tmp_path / "s")
    study = optuna.load_study(study_name=S.STUDY_NAME, storage=f"sqlite:///{tmp_path / 's' / 'study.db'}")
    assert [t.state.name for t in study.trials] == ["FAIL"]


def test_a_multi_vector_sweep_compares_its_maxsim_metric(tmp_path):
    """A multi-vector model's retrieval metrics are keyed by MaxSim (the kind's similarity): the sweep
    picks ``<set>_maxsim_ndcg@10`` and accepts a ``--metric`` of that key; a cosine key is refused."""
    from types import SimpleNamespace

    from cembed.config.file import load_config

    cfg = load_config(
        _config(tmp_path, "some-model"),
        ["model.kind=multi_vector", "loss.name=cached_maxsim", "eval.sts=[]", "eval.retrieval=[heldout]"],
    )
    sets = SimpleNamespace(retrieval=[SimpleNamespace(name="heldout")], sts=[])
    assert S.sweep_metric(cfg, None, sets) == ("heldout_maxsim_ndcg@10", True)
    assert S.sweep_metric(cfg, "eval_heldout_maxsim_recall@10", sets) == ("heldout_maxsim_recall@10", True)
    with pytest.raises(UserError, match="'heldout_cosine_ndcg@10' is not a metric"):
        S.sweep_metric(cfg, "heldout_cosine_ndcg@10", sets)
