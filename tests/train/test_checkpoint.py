"""cembed.train.checkpoint: which checkpoint a run resumes from (a half-written one never), what
the output folder may hold, and the interrupt callback's stop-after-this-step contract."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from transformers import TrainerControl, TrainerState

from cembed.errors import RunAbandoned, UserError
from cembed.train.checkpoint import (
    MARKER,
    REPEAT_WINDOW_S,
    STAGING,
    STEP_LOSSES,
    InterruptCallback,
    check_output_dir,
    check_resume_point,
    checkpoint_progress,
    checkpoints,
    completed_run,
    is_complete,
    is_sharded_checkpoint,
    later_checkpoints,
    latest_complete,
    mark_complete,
    read_step_losses,
    recorded_run,
    remove_checkpoints,
    remove_incomplete,
    resolve_resume,
    resume_on_restart,
    worker_init,
    write_step_losses,
)


def _send(signum: int) -> None:
    """Signal this process where the callback must not abandon the run (a RunAbandoned, a
    KeyboardInterrupt, would end pytest's session instead of failing the test)."""
    try:
        os.kill(os.getpid(), signum)
    except RunAbandoned as err:
        pytest.fail(f"abandoned where it must not be: {err!r}")


def _checkpoint(root, step, complete=True, state=None):
    folder = root / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"weights")
    if state is not None:
        (folder / "trainer_state.json").write_text(json.dumps(state))
    if complete:
        mark_complete(folder, step, run={"samples_per_step": 64})
    return folder


def test_checkpoints_sorted_by_step_number_not_name(tmp_path):
    for step in (100, 20, 3):
        _checkpoint(tmp_path, step)
    (tmp_path / "checkpoint-x").mkdir()  # not a step folder
    (tmp_path / "checkpoint-7").write_text("a file, not a folder")
    (tmp_path / "runs").mkdir()
    assert [p.name for p in checkpoints(tmp_path)] == ["checkpoint-3", "checkpoint-20", "checkpoint-100"]
    assert checkpoints(tmp_path / "missing") == []


def test_latest_complete_skips_a_half_written_checkpoint(tmp_path):
    _checkpoint(tmp_path, 10)
    good = _checkpoint(tmp_path, 20)
    _checkpoint(tmp_path, 30, complete=False)  # killed mid-save: no marker
    assert not is_complete(tmp_path / "checkpoint-30")
    assert latest_complete(tmp_path) == good
    assert resolve_resume(tmp_path, resume=True, resume_from=None) == str(good)
    assert latest_complete(tmp_path / "empty") is None


def test_marker_records_step_and_run(tmp_path):
    folder = _checkpoint(tmp_path, 12)
    marker = json.loads((folder / MARKER).read_text())
    assert marker["step"] == 12 and marker["run"] == {"samples_per_step": 64}
    assert set(marker) == {"step", "time", "run"} and abs(marker["time"] - time.time()) < 600  # when it was written
    assert recorded_run(folder) == {"samples_per_step": 64}
    (folder / MARKER).write_text("{not json")
    assert recorded_run(folder) is None  # unreadable marker
    assert recorded_run(tmp_path / "nowhere") is None


def test_remove_incomplete_deletes_unmarked_and_staging(tmp_path):
    keep = _checkpoint(tmp_path, 5)
    half = _checkpoint(tmp_path, 6, complete=False)
    (tmp_path / STAGING / "checkpoint-7").mkdir(parents=True)
    assert remove_incomplete(tmp_path) == [half]
    assert not half.exists() and not (tmp_path / STAGING).exists()
    assert keep.exists() and checkpoints(tmp_path) == [keep]


def test_resolve_resume_refusals(tmp_path):
    assert resolve_resume(tmp_path, resume=False, resume_from=None) is None
    _checkpoint(tmp_path, 4, complete=False)
    with pytest.raises(UserError, match="--resume: no complete checkpoint"):
        resolve_resume(tmp_path, resume=True, resume_from=None)
    with pytest.raises(UserError, match="not a complete cembed checkpoint"):
        resolve_resume(tmp_path, resume=False, resume_from=str(tmp_path / "checkpoint-4"))
    with pytest.raises(UserError, match="no such checkpoint folder"):
        resolve_resume(tmp_path, resume=False, resume_from=str(tmp_path / "checkpoint-99"))
    done = _checkpoint(tmp_path, 8)
    # --resume-from wins over --resume's newest pick
    _checkpoint(tmp_path, 9)
    assert resolve_resume(tmp_path, resume=True, resume_from=str(done)) == str(done)


def test_check_output_dir(tmp_path):
    check_output_dir(tmp_path / "new", overwrite=False, resuming=False)  # no folder yet
    (tmp_path / "run_summary.json").write_text(json.dumps({"status": "failed"}))
    check_output_dir(tmp_path, overwrite=False, resuming=False)  # a failed run may be replaced
    (tmp_path / "run_summary.json").write_text(json.dumps({"status": "completed"}))
    with pytest.raises(UserError, match="holds a finished model; pass --overwrite to replace it, or") as err:
        check_output_dir(tmp_path, overwrite=False, resuming=False)
    assert "--resume" not in str(err.value)  # no checkpoint to continue
    _checkpoint(tmp_path, 3)
    with pytest.raises(UserError, match="--overwrite to replace it, --resume to continue it"):
        check_output_dir(tmp_path, overwrite=False, resuming=False)
    check_output_dir(tmp_path, overwrite=True, resuming=False)
    check_output_dir(tmp_path, overwrite=False, resuming=True)
    # A stopped run (interrupted, failed, or killed before any summary) with a complete checkpoint:
    # a fresh run would mix its checkpoints with these, so it says how to continue instead.
    for status in ("interrupted", "failed", None):
        if status is None:
            (tmp_path / "run_summary.json").unlink()
        else:
            (tmp_path / "run_summary.json").write_text(json.dumps({"status": status}))
        with pytest.raises(UserError) as err:
            check_output_dir(tmp_path, overwrite=False, resuming=False)
        assert str(err.value) == (
            f"train.output_dir {tmp_path} holds a stopped run's checkpoint (checkpoint-3): continue it with --resume, "
            "start again with --overwrite (its checkpoints are removed), or choose another output_dir"
        )
        check_output_dir(tmp_path, overwrite=False, resuming=True)
        check_output_dir(tmp_path, overwrite=True, resuming=False)
    assert remove_checkpoints(tmp_path) == [tmp_path / "checkpoint-3"] and latest_complete(tmp_path) is None
    check_output_dir(tmp_path, overwrite=False, resuming=False)  # nothing left to continue
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "modules.json").write_text("[]")  # a saved SentenceTransformer, no summary
    with pytest.raises(UserError, match="holds a finished model"):
        check_output_dir(saved, overwrite=False, resuming=False)


def test_a_completed_run_is_one_whose_summary_model_and_length_say_so(tmp_path):
    """What makes a --resume of the folder a no-op (cembed train says "run already complete", exit 0)."""

    def summary(status="completed", max_steps=4, epochs=None, config=True):
        train = {"max_steps": max_steps, "num_train_epochs": epochs}
        (tmp_path / "run_summary.json").write_text(
            json.dumps({"status": status, **({"config": {"train": train}} if config else {})})
        )

    assert not completed_run(tmp_path, 4, None)  # no summary
    summary()
    assert not completed_run(tmp_path, 4, None)  # no final model
    (tmp_path / "modules.json").write_text("[]")
    assert completed_run(tmp_path, 4, None)
    assert not completed_run(tmp_path, 8, None)  # a longer run asked: not this one (its resume refuses)
    summary(max_steps=None, epochs=1.0)
    assert completed_run(tmp_path, None, 1.0) and not completed_run(tmp_path, None, 2.0)
    for status in ("interrupted", "failed", "abandoned"):
        summary(status=status)
        assert not completed_run(tmp_path, 4, None), status
    summary(config=False)  # a summary that does not record its config
    assert not completed_run(tmp_path, 4, None)
    (tmp_path / "run_summary.json").write_text("{not json")
    assert not completed_run(tmp_path, 4, None)


def test_check_resume_point(tmp_path):
    ck = _checkpoint(tmp_path, 40, state={"global_step": 40, "max_steps": 100})
    check_resume_point(str(ck), 100)
    check_resume_point(str(ck), None)
    with pytest.raises(UserError, match="belongs to a run of 100 steps, but train.max_steps is 120"):
        check_resume_point(str(ck), 120)
    # The last step's checkpoint of a run stopped during its final save or evaluation: resumed (the run's
    # end is done, nothing trained); of a finished run, or past train.max_steps: nothing to resume.
    check_resume_point(str(_checkpoint(tmp_path, 100, state={"global_step": 100, "max_steps": 100})), 100)
    with pytest.raises(UserError) as err:
        check_resume_point(str(ck), 40, finished=True)
    assert str(err.value) == (
        f"{ck} is at step 40, already at train.max_steps=40 and its run finished; nothing to resume "
        "(raise train.max_steps only for a fresh run with --overwrite)"
    )
    with pytest.raises(UserError) as err:
        check_resume_point(str(ck), 30)
    assert str(err.value) == (
        f"{ck} is at step 40, past train.max_steps=30; nothing to resume "
        "(raise train.max_steps only for a fresh run with --overwrite)"
    )
    with pytest.raises(UserError, match="no readable trainer_state.json"):
        check_resume_point(str(_checkpoint(tmp_path, 50)), 100)


def test_interrupt_finishes_the_step_then_saves_and_stops():
    cb = InterruptCallback()
    state, control = TrainerState(), TrainerControl()
    state.global_step = 3
    before = signal.getsignal(signal.SIGINT)
    before_term = signal.getsignal(signal.SIGTERM)
    cb.install()
    try:
        assert signal.getsignal(signal.SIGINT) != before and signal.getsignal(signal.SIGTERM) != before_term
        assert cb.on_step_end(None, state, control) is control
        assert (cb.step, control.should_save, control.should_training_stop) == (3, False, False)
        _send(signal.SIGTERM)  # handled: recorded, the process lives on
        assert cb.signum == signal.SIGTERM
        state.global_step = 4
        cb.on_step_end(None, state, control)
        assert (cb.step, control.should_save, control.should_training_stop) == (4, True, True)
        with pytest.raises(RunAbandoned) as abandoned:  # a second signal abandons the step at once
            os.kill(os.getpid(), signal.SIGINT)
        # step 4 was trained but its checkpoint not saved
        assert (abandoned.value.signum, abandoned.value.step, abandoned.value.exit_code) == (signal.SIGINT, 4, 130)
        assert isinstance(abandoned.value, KeyboardInterrupt)  # passes every library's `except Exception`
        assert signal.getsignal(signal.SIGINT) is before  # handlers restored
    finally:
        cb.uninstall()


def test_a_signal_after_the_last_step_is_late_and_a_second_abandons_the_run_end():
    """After the last optimizer step there is no step to finish: the first signal is recorded as
    late (the recipe finishes the run within train.stop_grace_seconds, or stops where --resume
    finishes it: cembed.train.stopping), and is announced without a step; a second abandons."""
    notices = []
    cb = InterruptCallback(on_signal=lambda signum, step: notices.append(step))
    state, control = TrainerState(), TrainerControl()
    state.global_step, state.max_steps = 4, 5
    before = signal.getsignal(signal.SIGTERM)
    cb.install()
    try:
        cb.on_train_begin(None, state, control)
        cb.on_step_end(None, state, control)  # step 4 of 5: a signal would still finish step 5
        assert not control.should_training_stop and not cb.trained
        state.global_step = 5
        cb.on_step_end(None, state, control)  # the last step
        _send(signal.SIGTERM)  # the process lives on: the run's end goes on
        cb.notice.join(5)
        assert (cb.signum, cb.late, notices) == (signal.SIGTERM, True, [None])
        with pytest.raises(RunAbandoned) as abandoned:
            os.kill(os.getpid(), signal.SIGTERM)
        assert (abandoned.value.step, abandoned.value.exit_code, abandoned.value.what) == (
            None,
            143,
            "the end of training",
        )
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        cb.uninstall()


def test_a_resume_of_the_last_step_starts_late():
    cb = InterruptCallback()
    state = TrainerState()
    state.global_step, state.max_steps = 6, 6
    cb.on_train_begin(None, state, TrainerControl())
    assert cb.trained


def test_a_launched_worker_takes_the_same_signal_again_at_once_for_the_same_one(monkeypatch):
    """A scheduler signals every process of the job and the launcher forwards its own: a rank gets
    SIGTERM twice within milliseconds, which must not abandon its step. Later, or another signal, does."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    now = [100.0]
    monkeypatch.setattr("cembed.train.checkpoint.time.monotonic", lambda: now[0])
    cb = InterruptCallback()
    cb.install()
    try:
        _send(signal.SIGTERM)
        now[0] += REPEAT_WINDOW_S / 2
        _send(signal.SIGTERM)  # the launcher's forward: the same delivery
        assert cb.signum == signal.SIGTERM and cb.at == 100.0
        now[0] = 100.0 + REPEAT_WINDOW_S  # the window is over: a signal of its own
        with pytest.raises(RunAbandoned):
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        cb.uninstall()
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")  # one process: a repeat is a person's second signal
    cb = InterruptCallback()
    cb.install()
    try:
        _send(signal.SIGTERM)
        with pytest.raises(RunAbandoned):
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        cb.uninstall()


def test_a_signal_that_reached_another_rank_stops_this_one_at_the_same_step(monkeypatch):
    """The ranks agree on the signal at every step's end (a max over the ranks): a rank that did not
    get it stops and saves with the others, or they would wait for it in the next step's all-reduce."""
    calls = []

    def peer_signalled(value):
        calls.append(value)
        return max(value, int(signal.SIGTERM))  # another rank reports SIGTERM

    monkeypatch.setattr("cembed.distributed.collectives.max_over_ranks", peer_signalled)
    cb = InterruptCallback()
    state, control = TrainerState(), TrainerControl()
    state.global_step, state.max_steps = 3, 10
    cb.on_step_end(None, state, control)
    assert calls == [0]  # this rank had none
    assert (cb.signum, control.should_save, control.should_training_stop) == (signal.SIGTERM, True, True)
    assert cb.at is not None  # the grace counts from when this rank learned of it


def test_data_loader_workers_ignore_stop_signals():
    """A scheduler's SIGTERM (and a terminal's Ctrl-C) reaches the data-loader workers too; they
    ignore it and keep producing batches (the main process decides, and ends them)."""
    import torch
    from torch.utils.data import DataLoader

    loader = DataLoader(range(64), batch_size=4, num_workers=2, worker_init_fn=worker_init(_check_ignored))
    it = iter(loader)
    batches = [next(it), next(it)]  # one from each worker: both have run worker_init
    for worker in it._workers:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP):  # USR1: Slurm's --signal
            os.kill(worker.pid, sig)
    batches += list(it)
    assert torch.cat(batches).tolist() == list(range(64))


def _check_ignored(worker_id: int) -> None:
    # the loader's own worker_init_fn runs after the signals are set to be ignored
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP):
        assert signal.getsignal(sig) is signal.SIG_IGN, sig


def test_a_restart_resumes_from_the_newest_complete_checkpoint(tmp_path):
    """torch's elastic agent restarts a failed job with TORCHELASTIC_RESTART_COUNT > 0: the attempt
    continues from the newest complete checkpoint, whatever the command line asked; the first
    attempt, or a restart before any complete checkpoint, runs as asked."""
    assert resume_on_restart(tmp_path, 0, False, None) == (False, None)
    assert resume_on_restart(tmp_path, 2, False, "elsewhere/checkpoint-4") == (False, "elsewhere/checkpoint-4")
    _checkpoint(tmp_path, 3, complete=False)
    assert resume_on_restart(tmp_path, 1, False, None) == (False, None)  # only a half-written one
    _checkpoint(tmp_path, 2)
    assert resume_on_restart(tmp_path, 1, False, None) == (True, None)
    assert resume_on_restart(tmp_path, 3, False, "elsewhere/checkpoint-4") == (True, None)
    assert resume_on_restart(tmp_path, 0, False, None) == (False, None)  # a first attempt as asked


def test_output_dir_messages_name_the_folder_relative_to_the_working_directory(tmp_path, monkeypatch):
    run = tmp_path / "runs" / "demo"
    run.mkdir(parents=True)
    (run / "run_summary.json").write_text(json.dumps({"status": "completed"}))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as err:
        check_output_dir(run, overwrite=False, resuming=False)
    assert str(err.value).startswith(f"train.output_dir {os.path.join('runs', 'demo')} holds a finished model")
    with pytest.raises(UserError, match=r"^--resume: no complete checkpoint in runs/demo; start without --resume$"):
        resolve_resume(run, resume=True, resume_from=None)


def test_the_first_signal_is_acknowledged_at_once_with_the_step_being_finished():
    """on_signal gets (signal, the step in progress) from a thread of its own, right away; a resumed
    run's step counts from the checkpoint's; the second signal still abandons at once."""
    heard = []
    cb = InterruptCallback(on_signal=lambda signum, step: heard.append((signum, step)))
    state = TrainerState()
    state.global_step, state.max_steps = 20, 40  # resumed at step 20 of 40
    cb.on_train_begin(None, state, TrainerControl())
    cb.install()
    try:
        _send(signal.SIGINT)
        cb.notice.join(5)
        assert heard == [(signal.SIGINT, 21)]
        assert cb.notice.daemon  # the notice never keeps the process alive
        with pytest.raises(KeyboardInterrupt) as abandoned:
            os.kill(os.getpid(), signal.SIGINT)
        assert abandoned.value.step == 21  # step 21 was being trained: abandoned, not saved
        assert heard == [(signal.SIGINT, 21)]  # the second signal is not announced as a first
    finally:
        cb.uninstall()


def test_published_best_is_the_same_on_every_rank_and_never_the_staging_folder(tmp_path):
    """The best checkpoint as ``state.best_model_checkpoint`` records it once published: derived from
    the trainer's state alone (the trainer's own record depends on whether the rank saw the staging
    folder at save time, and under FSDP ranks disagreed: None on one, a path on the other)."""
    from cembed.train.trainer import published_best

    run_dir = str(tmp_path / "run")
    staging = os.path.join(run_dir, STAGING)
    final = str(tmp_path / "run" / "checkpoint-3")
    # this step is the best so far: its checkpoint, whatever the trainer recorded (None or staged)
    for recorded in (None, os.path.join(staging, "checkpoint-3")):
        state = TrainerState(global_step=3, best_global_step=3, best_model_checkpoint=recorded)
        assert published_best(state, staging, run_dir) == final
    # an earlier best: its published folder (moved out of staging), or as recorded when already published
    state = TrainerState(global_step=5, best_global_step=3, best_model_checkpoint=os.path.join(staging, "checkpoint-3"))
    assert published_best(state, staging, run_dir) == final
    state = TrainerState(global_step=5, best_global_step=3, best_model_checkpoint=final)
    assert published_best(state, staging, run_dir) == final
    # a relative output_dir: the same spelling as the rotation's folder listing (Path-normalised)
    assert published_best(TrainerState(global_step=2, best_global_step=2), "./o/.staging", "./o") == "o/checkpoint-2"
    # no best yet (no metric, or no evaluation so far)
    assert published_best(TrainerState(global_step=5), staging, run_dir) is None


def test_summary_says_the_best_was_loaded_only_when_it_was(tmp_path):
    from cembed.train.evaluation import EvalLogCallback, TrainingEvaluation

    evaluation = TrainingEvaluation(
        sets=type("Sets", (), {"retrieval": [], "sts": []})(),
        evaluator=None,
        metric="sts_spearman_cosine",
        training_args={"greater_is_better": True},
        callback=EvalLogCallback(None, []),
    )
    ckpt = str(tmp_path / "checkpoint-2")
    state = TrainerState(best_metric=0.7, best_model_checkpoint=ckpt)
    best = evaluation.summary({}, {}, state, best_loaded=True)["best"]
    assert best["loaded"] is True and best["step"] == 2 and "is this checkpoint" in best["note"]
    best = evaluation.summary({}, {}, state, best_loaded=False)["best"]
    assert best["loaded"] is False and best["note"].startswith("not loaded")
    # no checkpoint recorded (the best evaluation was at a step without a save): never "loaded"
    best = evaluation.summary({}, {}, TrainerState(best_metric=0.7), best_loaded=True)["best"]
    assert best["loaded"] is False and best["step"] is None


@pytest.mark.parametrize("saved_sharded", [True, False])
def test_a_sharded_checkpoint_is_told_by_its_model_folder(tmp_path, saved_sharded):
    """Either layout resumes in either kind of run (tests/distributed/test_elastic.py); the trainer picks
    the loader by this."""
    checkpoint = tmp_path / "checkpoint-3"
    (checkpoint / "pytorch_model_fsdp_0" if saved_sharded else checkpoint).mkdir(parents=True)
    assert is_sharded_checkpoint(checkpoint) is saved_sharded


def test_a_resumed_runs_eval_history_keeps_the_evaluations_before_its_checkpoint():
    """Issue 38 item 5: the trainer restores a resumed run's log history before training begins; the
    evaluations in it stay in ``eval.during`` (not only those after the resume), without being shown
    again, and a fresh run's history starts empty."""
    from cembed.train.evaluation import EvalLogCallback

    lines: list[str] = []
    callback = EvalLogCallback(lines.append, ["sts_spearman_cosine"])
    history = [
        {"loss": 1.2, "step": 2},
        {"eval_sts_spearman_cosine": 0.5, "eval_runtime": 0.1, "step": 2},
        {"loss": 1.0, "step": 4},
        {"eval_sts_spearman_cosine": 0.6, "eval_samples_per_second": 9.0, "step": 4},
    ]
    callback.on_train_begin(None, TrainerState(global_step=4, log_history=history), None)
    assert callback.history == [
        {"step": 2, "metrics": {"sts_spearman_cosine": 0.5}},
        {"step": 4, "metrics": {"sts_spearman_cosine": 0.6}},
    ]
    assert lines == []
    callback.on_log(None, TrainerState(global_step=6), None, logs={"eval_sts_spearman_cosine": 0.7})
    assert [e["step"] for e in callback.history] == [2, 4, 6] and lines == ["eval step 6: sts_spearman_cosine 0.7000"]
    callback.on_train_begin(None, TrainerState(), None)
    assert callback.history == []


def test_a_signal_before_the_first_step_is_for_step_one():
    """Installed before the trainer starts (the model and data still loading): a signal then asks
    for the first step's checkpoint, not for the end of training."""
    heard = []
    cb = InterruptCallback(on_signal=lambda signum, step: heard.append((signum, step)))
    cb.install()
    try:
        _send(signal.SIGTERM)
        cb.notice.join(5)
        assert (heard, cb.late) == ([(signal.SIGTERM, 1)], False)
    finally:
        cb.uninstall()


def test_the_first_signal_starts_the_watch_for_a_failed_peer(monkeypatch):
    """In a multi-process job the launcher signals the other ranks after one failed; a signalled
    rank watches for that failure and ends with 128 + the signal's number (its step can never end)."""
    watched = []
    monkeypatch.setattr(
        "cembed.train.checkpoint.end_when_a_peer_fails", lambda exit_code: watched.append(exit_code) or "watcher"
    )
    cb = InterruptCallback()
    cb.install()
    try:
        _send(signal.SIGTERM)
        assert (watched, cb.peer_watch) == ([143], "watcher")
    finally:
        cb.uninstall()


@pytest.mark.parametrize(("first", "second"), [(signal.SIGUSR1, signal.SIGUSR1), (signal.SIGHUP, signal.SIGTERM)])
def test_sigusr1_and_sighup_stop_the_run_as_sigterm_does(first, second, sighup_default):
    """Slurm's --signal=USR1@120 and submitit send SIGUSR1 before a time limit, a closed terminal or ssh
    session SIGHUP: each finishes the step and saves (exit 128 + the signal), a second signal abandons.
    Without a handler either one ends the process at once, the steps since the last checkpoint lost."""
    cb = InterruptCallback()
    state, control = TrainerState(), TrainerControl()
    state.global_step = 3
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGHUP)}
    cb.install()
    try:
        for sig in before:  # (were one not handled, the signal below would end pytest itself)
            assert signal.getsignal(sig) not in (signal.SIG_DFL, signal.SIG_IGN, None), signal.Signals(sig).name
        _send(first)
        assert cb.signum == first
        cb.on_step_end(None, state, control)
        assert (control.should_save, control.should_training_stop) == (True, True)
        with pytest.raises(RunAbandoned) as abandoned:
            os.kill(os.getpid(), second)
        assert (abandoned.value.signum, abandoned.value.exit_code) == (second, 128 + second)
        assert {sig: signal.getsignal(sig) for sig in before} == before  # handlers restored
    finally:
        cb.uninstall()


def test_sighup_stays_ignored_under_nohup():
    """``nohup cembed train ...`` starts the process with SIGHUP ignored: the run outlives its terminal."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    cb = InterruptCallback()
    try:
        cb.install()
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, signal.SIG_IGN, None)
        cb.uninstall()
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        cb.uninstall()
        signal.signal(signal.SIGHUP, previous)


def test_a_forked_process_ignores_the_handler_it_inherited():
    """A data-loader worker forked after install() inherits the handler: it ignores the signal there
    (the main process decides), and the main process's callback records nothing."""
    cb = InterruptCallback()
    cb.install()
    try:
        pid = os.fork()
        if pid == 0:  # the child: the inherited handler must neither record nor abandon
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGTERM)
                os._exit(0 if cb.signum is None else 1)
            except BaseException:  # noqa: BLE001 - any way out of here is a failure, and only the child's
                os._exit(2)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        assert cb.signum is None
    finally:
        cb.uninstall()


def test_worker_init_ignores_both_signals_then_runs_the_loaders_own():
    """What a data-loader worker runs first (tests/train/test_checkpoint.py's loader test shows the
    workers surviving the signals; here in this process, so the calls are seen directly)."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)}
    seen = []
    try:
        worker_init(seen.append)(7)
        assert seen == [7]
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN and signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        for sig, handler in before.items():
            signal.signal(sig, handler)
        worker_init()(3)  # the loader has none of its own
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN and signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_checkpoint_progress_reads_the_trainer_state(tmp_path):
    ck = _checkpoint(tmp_path, 7, state={"global_step": 7, "max_steps": 20})
    assert checkpoint_progress(ck) == (7, 20)
    assert checkpoint_progress(_checkpoint(tmp_path, 8, state={"global_step": 8})) == (8, 0)  # planned unknown
    assert checkpoint_progress(_checkpoint(tmp_path, 9, state={})) == (0, 0)
    check_resume_point(str(tmp_path / "checkpoint-8"), 100)  # an unknown plan is not refused
    missing = _checkpoint(tmp_path, 10)
    with pytest.raises(UserError) as err:
        checkpoint_progress(missing)
    assert str(err.value) == f"{missing}: no readable trainer_state.json; resume from another checkpoint"


def test_a_checkpoint_that_cannot_be_removed_does_not_stop_the_cleanup(tmp_path):
    """``--overwrite`` and a fresh start remove what they can; a link named like a checkpoint (which
    ``shutil.rmtree`` refuses to follow) is left, and so is the folder it points to."""
    elsewhere = tmp_path / "elsewhere"
    _checkpoint(elsewhere, 4, complete=False)
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint-4").symlink_to(elsewhere / "checkpoint-4", target_is_directory=True)
    half = _checkpoint(run, 5, complete=False)
    assert remove_incomplete(run) == [run / "checkpoint-4", half]
    assert not half.exists() and (elsewhere / "checkpoint-4" / "model.safetensors").exists()
    done = _checkpoint(run, 6)
    assert remove_checkpoints(run) == [run / "checkpoint-4", done]
    assert not done.exists() and (elsewhere / "checkpoint-4" / "model.safetensors").exists()


def test_step_losses_kept_in_a_checkpoint_read_back_and_nothing_from_a_bad_file(tmp_path):
    folder = _checkpoint(tmp_path, 2)
    assert read_step_losses(folder) == {}  # an older cembed's checkpoint: none kept
    write_step_losses(folder, [(1, 2.5), (2, 2.25)])
    assert json.loads((folder / STEP_LOSSES).read_text()) == [[1, 2.5], [2, 2.25]]
    assert read_step_losses(str(folder)) == {1: 2.5, 2: 2.25}
    for bad in ("not json", '[["one", 2.5]]', "[[1]]", "[1]"):  # unreadable, a bad step, a pair short, no pair
        (folder / STEP_LOSSES).write_text(bad)
        assert read_step_losses(folder) == {}, bad


def test_later_checkpoints_are_the_complete_ones_after_a_checkpoint_of_the_same_folder(tmp_path, monkeypatch):
    run = tmp_path / "run"
    for step, complete in ((2, True), (4, True), (6, False), (10, True)):
        _checkpoint(run, step, complete=complete)
    assert later_checkpoints(run, run / "checkpoint-2") == [run / "checkpoint-4", run / "checkpoint-10"]
    assert later_checkpoints(str(run), str(run / "checkpoint-4")) == [run / "checkpoint-10"]  # not itself
    assert later_checkpoints(run, run / "checkpoint-10") == []
    monkeypatch.chdir(tmp_path)  # a relative --resume-from names the same folder
    assert later_checkpoints(run, "run/checkpoint-4") == [run / "checkpoint-10"]
    other = _checkpoint(tmp_path / "other", 1)  # another run's checkpoint: nothing of this one replaced
    assert later_checkpoints(run, other) == []
    best = run / "best-checkpoint-2"  # in the folder, not a step folder
    best.mkdir()
    assert later_checkpoints(run, best) == []
