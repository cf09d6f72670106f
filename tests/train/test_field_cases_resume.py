"""Field cases of issue 38 (preemption and resume), one process: each public bug report about the same
feature in the field's tools, tried on cembed and compared with a reference computed without cembed's
resume: the uninterrupted run of the same config (its step losses and final weights).

- transformers#40691, accelerate#2016 and accelerate#4071: a run resumed mid-epoch in its second
  epoch trained the first epoch's order (the skipping loader reset the sampler's epoch to 0).
- accelerate#1451: the batches skipped on resume were skipped again in every later epoch.
- KempnerForge#57: a second resume within one epoch landed on the wrong batch.
- transformers#38939 (fixed by #40347): with gradient accumulation and an epoch whose last step has
  fewer batches, a resumed run lost track of the epoch's end and did not train (or save) its last step.
- tftrainer#7, Lightning-AI/pytorch-lightning#688, vllm-project/speculators#739: a second Ctrl-C
  (or a kill) while a checkpoint is written leaves a half-written newest checkpoint that the resume
  then picks.
- bghira/SimpleTuner#2989, unslothai/unsloth-zoo#782: a run continued from an earlier checkpoint
  in its own folder left the later checkpoints of the run it replaces beside its own, and the newest
  of either was taken as the place to resume (or kept by the rotation instead of the one just saved).
- sentence-transformers#3348: the no-duplicates sampler's epochs differ in length on duplicate-heavy
  data, and the trainer, which plans every epoch with the first one's length, ended short of
  ``train.max_steps`` (tests/data/batching/test_full_table.py has the sampler's own case).

The stops are real signals delivered to this process through the run's own handler, during the step
named (the step finishes and its checkpoint is saved), as tests/train/test_stop_signals.py does.
"""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path

import pytest
from safetensors.torch import load_file

import cembed.train.recipe as T
import cembed.train.trainer as trainer_module
from cembed.config.file import config_from_dict
from cembed.errors import RunAbandoned, RunInterrupted, UserError
from cembed.train.checkpoint import MARKER, STAGING, latest_complete

pytestmark = pytest.mark.slow  # every test trains

STEPS = 14  # 48 rows, 6 batches of 8 per epoch: steps 1-6, 7-12, 13-14
ROWS = [{"anchor": f"a query about topic {i}", "positive": f"the passage on topic {i}"} for i in range(48)]


def _dense_rows() -> list[dict]:
    # 12 anchors x 30 positives over 48 rows: with seed 2 the sampler's own shuffles fit 5, 5, 4, 5, 5
    # batches of 8 in epochs 0-4 (tests/data/batching/test_full_table.py, the same draw).
    pick = random.Random(0)
    pairs = [(f"topic {pick.randrange(12)}", f"answer {pick.randrange(30)}") for _ in range(48)]
    return [{"anchor": a, "positive": p} for a, p in pairs]


def _config(folder: Path, model_dir: Path, name: str, rows: list[dict], steps: int, seed: int = 5, **train):
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return config_from_dict(
        {
            "model": {"name_or_path": str(model_dir), "device": "cpu", "max_seq_length": 32},
            "data": {"train": str(data), "cache_dir": str(folder / "cache")},
            "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
            "optim": {"learning_rate": 1e-2, "lr_scaling": "none", "warmup_ratio": 0.2},
            "train": {
                "max_steps": steps,
                "logging_steps": 1,
                "save_steps": 2,
                "output_dir": str(folder / name),
                "seed": seed,
                **train,
            },
        }
    )


def _with_batch(cfg, **batch):
    """``cfg`` with ``batch`` fields changed."""
    return cfg.model_copy(update={"batch": cfg.batch.model_copy(update=batch)})


def _run(cfg, **kwargs) -> dict:
    plan, data = T.check_run_inputs(cfg)
    return T.run_training(cfg, plan, data, **kwargs)


def _stop_during(monkeypatch, step: int, signum: int = signal.SIGTERM) -> None:
    """Deliver ``signum`` to this process during step ``step`` (it finishes the step, saves, stops)."""

    class Signalling(T.InterruptCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step + 1 == step and self.signum is None:
                os.kill(os.getpid(), signum)
            return control

    monkeypatch.setattr(T, "InterruptCallback", Signalling)


def _max_dw(a: Path, b: Path) -> float:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


def _loss_gap(resumed: dict, reference: dict) -> float:
    """The largest step-loss difference over the steps the resumed run trained (all of them must be
    the reference's steps)."""
    ref = dict(reference["step_losses"])
    steps = [s for s, _ in resumed["step_losses"]]
    assert steps and all(s in ref for s in steps), steps
    return max(abs(v - ref[s]) for s, v in resumed["step_losses"])


def _logged_gap(resumed: dict, reference: dict) -> float:
    """The largest difference of the logged losses (``losses``: the trainer's interval means, as
    ``train.log``), which must be logged at the reference's steps."""
    assert [s for s, _ in resumed["losses"]] == [s for s, _ in reference["losses"]]
    return max(abs(a - b) for (_, a), (_, b) in zip(resumed["losses"], reference["losses"]))


@pytest.fixture(scope="module")
def straight(tiny_model_dir, tmp_path_factory):
    """The uninterrupted run: its summary and folder, and the folder the other runs share."""
    folder = tmp_path_factory.mktemp("field_resume")
    summary = _run(_config(folder, tiny_model_dir, "straight", ROWS, STEPS))
    assert summary["status"] == "completed" and [s for s, _ in summary["step_losses"]] == list(range(1, STEPS + 1))
    return folder, summary


@pytest.mark.parametrize(
    "stops",
    [
        pytest.param((8,), id="second-epoch"),  # transformers#40691, accelerate#2016 / #4071
        pytest.param((2, 4), id="twice-in-the-first-epoch"),  # accelerate#1451, KempnerForge#57
    ],
)
def test_a_resume_trains_the_uninterrupted_runs_batches_in_every_later_epoch(
    straight, tiny_model_dir, monkeypatch, stops
):
    folder, reference = straight
    name = "stops-" + "-".join(map(str, stops))
    cfg = _config(folder, tiny_model_dir, name, ROWS, STEPS)
    for i, step in enumerate(stops):
        _stop_during(monkeypatch, step)
        with pytest.raises(RunInterrupted) as stopped:
            _run(cfg, resume=i > 0)
        assert stopped.value.step == step
        monkeypatch.undo()
    summary = _run(cfg, resume=True)
    assert summary["status"] == "completed" and summary["resumed_from"] == str(
        folder / name / f"checkpoint-{stops[-1]}"
    )
    # every step: those before the checkpoint kept in it (issue 38 item 5), those after trained now
    assert [s for s, _ in summary["step_losses"]] == list(range(1, STEPS + 1))
    assert _logged_gap(summary, reference) <= 1e-6
    gap, d_w = _loss_gap(summary, reference), _max_dw(folder / "straight", folder / name)
    print(f"\nstopped at {stops}, resumed: step-loss gap {gap:.1e}, max|dW| {d_w:.1e}")
    assert gap <= 1e-6 and d_w <= 1e-6


def test_a_resume_with_accumulation_trains_each_epochs_short_last_step(tiny_model_dir, tmp_path, monkeypatch):
    """transformers#38939: 40 rows are 5 batches of 8 per epoch; 2 batches per optimizer step make 3
    steps an epoch, the third of one batch. Stopped at step 5 (mid-epoch, before the one-batch step
    6), the resumed run trains steps 6 and 7 as the uninterrupted run."""
    rows = ROWS[:40]
    straight = _run(_with_batch(_config(tmp_path, tiny_model_dir, "accum", rows, 7), gradient_accumulation_steps=2))
    assert straight["data"]["batches_per_epoch"] == 5 and straight["steps"] == 7
    assert straight["samples_seen"] == 40 + 40 + 16  # 16 + 16 + 8 rows an epoch, then one step of 16
    cfg = _with_batch(_config(tmp_path, tiny_model_dir, "accum-stopped", rows, 7), gradient_accumulation_steps=2)
    _stop_during(monkeypatch, 5)
    with pytest.raises(RunInterrupted):
        _run(cfg)
    monkeypatch.undo()
    stopped = json.loads((tmp_path / "accum-stopped" / "run_summary.json").read_text())
    assert stopped["status"] == "interrupted" and [s for s, _ in stopped["step_losses"]] == [1, 2, 3, 4, 5]
    resumed = _run(cfg, resume=True)
    assert [s for s, _ in resumed["step_losses"]] == [1, 2, 3, 4, 5, 6, 7]
    assert resumed["samples_seen"] == straight["samples_seen"]
    gap, d_w = _loss_gap(resumed, straight), _max_dw(tmp_path / "accum", tmp_path / "accum-stopped")
    print(f"\naccumulation 2, 5 batches an epoch, stopped at 5: loss gap {gap:.1e}, max|dW| {d_w:.1e}")
    assert gap <= 1e-6 and d_w <= 1e-6


def test_a_second_sigint_while_the_checkpoint_is_written_leaves_the_last_complete_one(
    straight, tiny_model_dir, monkeypatch
):
    """tftrainer#7, Lightning-AI/pytorch-lightning#688, vllm-project/speculators#739: the first
    Ctrl-C during step 3 asks for checkpoint-3; the second comes when its files are written but not
    yet marked complete. The run is abandoned, no ``checkpoint-3`` exists (its staged copy is never
    resumed), ``--resume`` continues checkpoint-2 and ends with the uninterrupted run's weights."""
    folder, reference = straight
    cfg = _config(folder, tiny_model_dir, "twice-in-save", ROWS, STEPS)
    out = folder / "twice-in-save"
    _stop_during(monkeypatch, 3, signal.SIGINT)
    mark = trainer_module.mark_complete

    def interrupted_mark(checkpoint_dir, step, run=None):
        if step == 3:  # the staged checkpoint-3 holds every file but the marker
            assert (Path(checkpoint_dir) / "model.safetensors").exists()
            os.kill(os.getpid(), signal.SIGINT)
        return mark(checkpoint_dir, step, run)

    monkeypatch.setattr(trainer_module, "mark_complete", interrupted_mark)
    with pytest.raises(RunAbandoned) as abandoned:
        _run(cfg)
    monkeypatch.undo()
    assert abandoned.value.what == "step 3"
    assert not (out / "checkpoint-3").exists() and not (out / STAGING / "checkpoint-3" / MARKER).exists()
    assert latest_complete(out) == out / "checkpoint-2"
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["status"] == "abandoned" and summary["last_checkpoint"] == str(out / "checkpoint-2")
    summary = _run(cfg, resume=True)
    assert summary["resumed_from"] == str(out / "checkpoint-2") and not (out / STAGING).exists()
    gap, d_w = _loss_gap(summary, reference), _max_dw(folder / "straight", out)
    print(
        f"\nsecond SIGINT in the save of checkpoint-3, resumed from checkpoint-2: loss gap {gap:.1e}, max|dW| {d_w:.1e}"
    )
    assert gap <= 1e-6 and d_w <= 1e-6


def test_resuming_an_earlier_checkpoint_of_the_folder_replaces_its_later_ones(straight, tiny_model_dir, monkeypatch):
    """bghira/SimpleTuner#2989, unslothai/unsloth-zoo#782: a run stopped at step 5 holds checkpoint-2,
    -4 and -5; continued ``--resume-from checkpoint-2`` and stopped at step 3, its printed ``--resume``
    took the replaced run's checkpoint-5 (the newest) instead of the checkpoint-3 it had just saved.
    ``--resume-from`` an earlier checkpoint now names the later ones and asks for ``--overwrite``,
    which removes them; the run then resumes its own checkpoint-3 and ends as the uninterrupted run."""
    folder, reference = straight
    cfg = _config(folder, tiny_model_dir, "branch", ROWS, STEPS)
    out = folder / "branch"
    _stop_during(monkeypatch, 5)
    with pytest.raises(RunInterrupted):
        _run(cfg)
    assert [p.name for p in sorted(out.glob("checkpoint-*"))] == ["checkpoint-2", "checkpoint-4", "checkpoint-5"]
    with pytest.raises(UserError) as refused:
        _run(cfg, resume_from=str(out / "checkpoint-2"))
    assert "also holds the later checkpoint-4, checkpoint-5" in str(refused.value)
    assert "--overwrite" in str(refused.value)
    _stop_during(monkeypatch, 3)
    with pytest.raises(RunInterrupted):
        _run(cfg, resume_from=str(out / "checkpoint-2"), overwrite=True)
    monkeypatch.undo()
    assert [p.name for p in sorted(out.glob("checkpoint-*"))] == ["checkpoint-2", "checkpoint-3"]
    assert "removed the later checkpoint-4, checkpoint-5" in (out / "train.log").read_text()
    summary = _run(cfg, resume=True)
    assert summary["resumed_from"] == str(out / "checkpoint-3")
    gap, d_w = _loss_gap(summary, reference), _max_dw(folder / "straight", out)
    print(f"\nresumed from checkpoint-2 over a run stopped at 5, then --resume: loss gap {gap:.1e}, max|dW| {d_w:.1e}")
    assert gap <= 1e-6 and d_w <= 1e-6


def test_duplicate_heavy_data_trains_max_steps(tiny_model_dir, tmp_path):
    """sentence-transformers#3348 through the trainer: 15 steps asked with 5 batches in epoch 0 and a
    shuffle of epoch 2 that fits only 4. The run trains 15 steps (it trained 14 and said completed)."""
    straight = _run(_config(tmp_path, tiny_model_dir, "dense", _dense_rows(), 15, seed=2))
    assert straight["data"]["batches_per_epoch"] == 5
    assert straight["steps"] == 15 and [s for s, _ in straight["step_losses"]] == list(range(1, 16))
    assert straight["samples_seen"] == 15 * 8 and straight["epochs"] == 3.0
