"""cembed.train.checkpoint: which checkpoint a run resumes from (a half-written one never), what
the output folder may hold, and the interrupt callback's stop-after-this-step contract."""

from __future__ import annotations

import json
import os
import signal

import pytest
from transformers import TrainerControl, TrainerState

from cembed.errors import UserError
from cembed.train.checkpoint import (
    MARKER,
    STAGING,
    InterruptCallback,
    check_output_dir,
    check_resume_point,
    checkpoints,
    is_complete,
    is_sharded_checkpoint,
    latest_complete,
    mark_complete,
    recorded_run,
    remove_incomplete,
    resolve_resume,
)


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
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "modules.json").write_text("[]")  # a saved SentenceTransformer, no summary
    with pytest.raises(UserError, match="holds a finished model"):
        check_output_dir(saved, overwrite=False, resuming=False)


def test_check_resume_point(tmp_path):
    ck = _checkpoint(tmp_path, 40, state={"global_step": 40, "max_steps": 100})
    check_resume_point(str(ck), 100)
    check_resume_point(str(ck), None)
    with pytest.raises(UserError, match="belongs to a run of 100 steps, but train.max_steps is 120"):
        check_resume_point(str(ck), 120)
    with pytest.raises(UserError, match="is at step 40, already at train.max_steps=40"):
        check_resume_point(str(ck), 40)
    with pytest.raises(UserError, match="no readable trainer_state.json"):
        check_resume_point(str(_checkpoint(tmp_path, 50)), 100)


def test_interrupt_finishes_the_step_then_saves_and_stops():
    cb = InterruptCallback()
    state, control = TrainerState(), TrainerControl()
    state.global_step = 3
    before = signal.getsignal(signal.SIGINT)
    cb.install()
    try:
        assert cb.on_step_end(None, state, control) is control
        assert (cb.step, control.should_save, control.should_training_stop) == (3, False, False)
        os.kill(os.getpid(), signal.SIGTERM)  # handled: recorded, the process lives on
        assert cb.signum == signal.SIGTERM
        state.global_step = 4
        cb.on_step_end(None, state, control)
        assert (cb.step, control.should_save, control.should_training_stop) == (4, True, True)
        with pytest.raises(KeyboardInterrupt):  # a second signal abandons the step at once
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is before  # handlers restored
    finally:
        cb.uninstall()


def test_a_signal_after_the_last_step_ends_the_process_at_once():
    """After the last optimizer step there is no step to finish: what follows (loading the best
    checkpoint, a collective that may hang when a peer died) must not hold a signal back, or a worker
    outlives the launcher's SIGTERM. The first signal then acts as the default handler would."""
    notices = []
    cb = InterruptCallback(on_signal=lambda signum, step: notices.append(step))
    state, control = TrainerState(), TrainerControl()
    state.global_step, state.max_steps = 4, 5
    before = signal.getsignal(signal.SIGINT)
    cb.install()
    try:
        cb.on_train_begin(None, state, control)
        cb.on_step_end(None, state, control)  # step 4 of 5: a signal would still finish step 5
        assert not control.should_training_stop
        state.global_step = 5
        cb.on_step_end(None, state, control)  # the last step
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is before and cb.signum is None and notices == []
    finally:
        cb.uninstall()


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
        os.kill(os.getpid(), signal.SIGINT)
        cb.notice.join(5)
        assert heard == [(signal.SIGINT, 21)]
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
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
