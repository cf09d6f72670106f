"""The progress bar of ``cembed train`` (cembed.cli.display.run.RichProgress) driven by hand on a fake
clock: where it starts, each step's loss and LR, the ETA from the first step, this process's rate;
the lines for a resume, a signal and an abandoned run."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from rich.console import Console

from cembed.cli.display.run import RichRunDisplay, abandoned_message, interrupted_before_training
from cembed.files import display_path
from cembed.train.meter import StepClock
from cembed.train.trainer import RunLog, RunLogCallback, progress_line


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _optimizer(lr: float):
    return SimpleNamespace(param_groups=[{"lr": lr}])


def test_a_resumed_bar_starts_at_the_checkpoint_and_shows_each_step():
    """Resumed at step 20 of 40, 45 s a step, 8 samples a step, logging every 10 steps: the bar
    starts at 20/40, and after step 21 shows step 21's loss and LR (not the last logged ones), an
    ETA of 19 x 45 s and 8 / 45 samples/s (not 21 x 8 / 45)."""
    clock = Clock(100.0)
    log = RunLog(clock=StepClock(clock=clock))
    losses = {21: 0.25}
    callback = RunLogCallback(log, 8, step_loss=losses.get)
    console = Console(record=True, width=200, force_terminal=False)
    display = RichRunDisplay(console)
    bar = display.progress(log, 8)
    state = SimpleNamespace(global_step=20, max_steps=40, is_world_process_zero=True)
    for cb in (callback, bar):
        cb.on_train_begin(None, state, None)
    assert bar.step == 20 and bar.progress.tasks[0].completed == 20
    callback.on_step_begin(None, state, None, optimizer=_optimizer(1.5e-4))  # the LR step 21 uses
    clock.now += 45.0
    state.global_step = 21
    for cb in (callback, bar):
        cb.on_step_end(None, state, None, optimizer=_optimizer(1.4e-4))  # the scheduler stepped
    assert (log.step_loss, log.step_lr) == (0.25, 1.5e-4)
    line = progress_line(21, 40, log, 8, {})
    assert line.endswith("0.2 samples/s")  # 8 samples in 45 s
    display.close()
    text = console.export_text()
    assert "21/40 loss 0.2500  lr 1.50e-04  0.2 samples/s eta 0:14:15" in text, text


def test_the_lines_of_a_resume_an_interrupt_and_an_abandoned_run(tmp_path):
    console = Console(record=True, width=400)
    display = RichRunDisplay(console)
    display.resuming("out/checkpoint-20", 20, 40)
    display.interrupt("SIGINT", 21)
    display.interrupt("SIGTERM", 7)
    display.interrupt("SIGTERM", 40, 90.0)  # the last step: the run is finished if that fits in the grace
    display.interrupt("SIGINT", None, 30.0)  # after the last step
    assert console.export_text().splitlines() == [
        "resuming from out/checkpoint-20 at step 20 of 40",
        "Ctrl-C: finishing step 21, then saving a checkpoint; Ctrl-C again to abandon",
        "SIGTERM: finishing step 7, then saving a checkpoint; send SIGTERM again to abandon",
        "SIGTERM: finishing step 40 (the last), then the run if that fits in train.stop_grace_seconds (90 s), else "
        "saving a checkpoint from which --resume finishes it; send SIGTERM again to abandon",
        "Ctrl-C after the last step: finishing the run (final model, evaluation, summary) if that fits in "
        "train.stop_grace_seconds (30 s), else stopping where --resume finishes it; Ctrl-C again to abandon",
    ]
    assert interrupted_before_training(str(tmp_path), tmp_path / "c.yaml", None) == (
        "[yellow]interrupted[/] before training started; no checkpoint to resume from"
    )
    assert abandoned_message("SIGTERM", "step 4", str(tmp_path), tmp_path / "c.yaml", None) == (
        "[yellow]abandoned step 4[/] (SIGTERM again): not saved; no checkpoint to resume from"
    )
    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "checkpoint-3" / "cembed_checkpoint_complete.json").write_text("{}")
    text = abandoned_message("SIGINT", "the evaluation", str(tmp_path), tmp_path / "c.yaml", ["train.seed=1"])
    assert text.startswith("[yellow]abandoned the evaluation[/] (Ctrl-C again): not saved; ")
    assert f"the last complete checkpoint is {display_path(tmp_path / 'checkpoint-3')}" in text
    assert text.endswith(f"resume with: cembed train {tmp_path / 'c.yaml'} train.seed=1 --resume")


def test_the_tokenize_bar_shows_rows_and_rate_on_a_terminal_only(monkeypatch):
    import time as time_mod

    now = [1000.0]
    monkeypatch.setattr(time_mod, "perf_counter", lambda: now[0])
    console = Console(record=True, width=200, force_terminal=True)
    with RichRunDisplay(console).tokenize_progress() as progress:
        now[0] += 2.0
        progress(3000, 10000)  # 3,000 rows in 2 s
        bar = progress.__self__
        assert bar.progress.tasks[0].completed == 3000 and bar.progress.tasks[0].fields["rate"] == "1,500"
        console.print(bar.progress.get_renderable())
    assert "3000/10000 1,500 rows/s" in console.export_text()
    assert bar.progress is None  # stopped when the context ends
    for quiet in (Console(force_terminal=False), Console(force_terminal=True, quiet=True)):
        with RichRunDisplay(quiet).tokenize_progress() as progress:
            assert progress is None  # not a terminal, or another rank's quiet console: nothing drawn
    with RichRunDisplay(Console(force_terminal=True), progress=False).tokenize_progress() as progress:
        assert progress is None


def _done_summary(counts, earlier=()):
    stream = {"window_batches": 0, "shuffle_buffer": 0, "rank": 0, "world_size": 1, "pass": len(earlier)}
    stream |= {"counts": counts, "earlier_passes": list(earlier)}
    return {
        "steps": 10,
        "samples_seen": 80,
        "wall_time_s": 2.0,
        "samples_per_s": 40.0,
        "first_loss": 2.0,
        "last_loss": 1.0,
        "output_dir": "out",
        "data": {"sources": [{"name": "pairs", "stream": stream}]},
    }


def test_done_prints_the_streams_counts_and_warns_when_many_rows_were_dropped():
    """4,096 rows read from a sorted file in file order (shuffle_buffer 0): 2,289 dropped; the
    closing lines say so and suggest a shuffle buffer. Under 5 % dropped: the counts, no warning."""
    from cembed.cli.display.run import print_done

    console = Console(record=True, width=400)
    counts = {"rows_read": 4096, "placed": 1800, "dropped": 2289, "left_at_end": 7}
    print_done(console, _done_summary(counts))
    text = console.export_text()
    assert "stream: 4,096 rows read, 1,800 placed in batches, 2,289 dropped (55.9%)" in text, text
    assert "data.train.streaming.shuffle_buffer" in text and "sorted" in text
    console = Console(record=True, width=400)
    first = {"rows_read": 72, "placed": 64, "dropped": 1, "left_at_end": 7}
    print_done(console, _done_summary({"rows_read": 30, "placed": 24, "dropped": 0, "left_at_end": 0}, [first]))
    text = console.export_text()
    assert "stream: 102 rows read, 88 placed in batches, 1 dropped (1.0%)" in text, text
    assert "shuffle_buffer" not in text


def test_the_step_line_labels_an_interval_mean_the_bar_does_not_show():
    """Logging every 10 steps: at step 40 the bar shows step 40's loss (0.7501) and the step line the
    trainer's logged loss, the mean over steps 31-40 (0.9353), labelled so; a one-step interval is the
    bar's loss (the global step's, as the logged one, with several processes too), unlabelled."""
    lines: list[str] = []
    log = RunLog(clock=StepClock(clock=Clock(0.0)))
    callback = RunLogCallback(log, 8, on_line=lines.append, step_loss={40: 0.7501}.get)
    console = Console(record=True, width=200, force_terminal=False)
    display = RichRunDisplay(console)
    bar = display.progress(log, 8)
    state = SimpleNamespace(global_step=20, max_steps=100, is_world_process_zero=True)
    for cb in (callback, bar):
        cb.on_train_begin(None, state, None)
    state.global_step = 30
    callback.on_log(None, state, None, logs={"loss": 1.2, "learning_rate": 1e-4})
    state.global_step = 40
    for cb in (callback, bar):
        cb.on_step_end(None, state, None)
    callback.on_log(None, state, None, logs={"loss": 0.9353, "learning_rate": 1e-4})
    display.close()
    assert [line.split("  lr")[0] for line in lines] == [
        "step 30/100  loss 1.2000 (mean of steps 21-30)",  # a resumed run's first interval starts after its step
        "step 40/100  loss 0.9353 (mean of steps 31-40)",
    ]
    assert "40/100 loss 0.7501  lr" in console.export_text()  # the bar: step 40's own loss
    state.global_step = 41
    callback.on_log(SimpleNamespace(world_size=4), state, None, logs={"loss": 0.5})
    assert lines[2].split("  lr")[0] == "step 41/100  loss 0.5000"
    assert progress_line(40, 100, log, 8, {}, since=30).startswith("step 40/100  loss 0.5000 (mean of steps 31-40)  lr")
    from cembed.cli.display.run import print_done

    console = Console(record=True, width=400)
    print_done(console, _done_summary({"rows_read": 30, "placed": 24, "dropped": 0, "left_at_end": 0}))
    assert "loss 2.0000 -> 1.0000 (first and last logged means)" in console.export_text()


@pytest.mark.slow
def test_a_runs_labelled_interval_mean_is_the_mean_of_its_step_losses(
    tiny_model_dir, write_config, pairs_file, tmp_path
):
    """A real run logging every 3 steps (and its first step): each train.log line's loss is labelled
    the mean of the steps since the last line, and it is the mean of those steps' own losses
    (run_summary.json's ``step_losses``, what the bar shows), to the 4 decimals printed; the first
    step's line is that step's loss, unlabelled."""
    import json

    from conftest import distinct_pairs
    from typer.testing import CliRunner

    from cembed.cli.app import app

    config = write_config(
        {
            "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
            "data": {"train": str(pairs_file(distinct_pairs(64)))},
            "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
            "optim": {"learning_rate": 1e-3, "base_batch_size": 8},
            "train": {"max_steps": 6, "logging_steps": 3, "output_dir": str(tmp_path / "out"), "seed": 1},
        }
    )
    r = CliRunner().invoke(app, ["train", str(config)])
    assert r.exit_code == 0, r.output
    steps = dict(map(tuple, json.loads((tmp_path / "out" / "run_summary.json").read_text())["step_losses"]))
    lines = [line for line in (tmp_path / "out" / "train.log").read_text().splitlines() if "  loss " in line]
    logged = [re.search(r"step (\d+)/6  loss (\S+)( \(mean of steps (\d+)-(\d+)\))?  lr", line) for line in lines]
    assert all(logged), lines
    spans = [(int(m[1]), m[4] and int(m[4]), m[5] and int(m[5])) for m in logged]
    assert spans == [(1, None, None), (3, 2, 3), (6, 4, 6)], lines
    for m, (step, first, last) in zip(logged, spans):
        span = range(first, last + 1) if first else [step]
        assert abs(float(m[2]) - sum(steps[s] for s in span) / len(span)) < 1e-4, (m[0], steps)


def test_the_streams_counts_of_several_processes_are_the_global_batches():
    """With 2 processes every rank reads the whole stream: the counts are the global batches', not
    one rank's share (issue 38 item 6)."""
    from cembed.cli.display.run import print_done

    console = Console(record=True, width=400)
    summary = _done_summary({"rows_read": 200, "placed": 96, "dropped": 3, "left_at_end": 0})
    summary["data"]["sources"][0]["stream"]["world_size"] = 2
    print_done(console, summary)
    text = " ".join(console.export_text().split())
    assert (
        "stream: 200 rows read, 96 placed in batches, 3 dropped (1.5%) (global batches of 2 processes, each reading "
        "the whole stream)"
    ) in text, text
