"""Stop signals as clusters send them (issue 38 items 1-3): to every process of the job, in or after
the last step, and twice.

- SIGTERM to the whole process group (Slurm, Kubernetes: every process of the job, the data-loader
  workers included) at step 3: the workers ignore it, the main process saves checkpoint-3 and exits
  143, and ``--resume`` ends with the uninterrupted run's weights. The same with SIGUSR1 (Slurm's
  ``--signal=USR1@120``, submitit's default), exit 138: before, it killed every process unsaved.
- SIGTERM during the last step, or 0.5 s after it (in the final save): with the default
  ``train.stop_grace_seconds`` the run is finished (model, evaluation, summary, exit 0); with a grace
  the run's end does not fit in, it stops with a checkpoint of the last step and prints a command
  that finishes the run without training (the resume of the last step's checkpoint). Either way the
  weights are the uninterrupted run's and ``run_summary.json`` says where the signal came.
- A second SIGTERM in one process abandons the step: the abandon line, ``train.log`` and the summary's
  status ``abandoned``.

The in-process runs (``CliRunner``) deliver real signals to this process through the run's own
handler; the process-group one runs in a process of its own (a new session).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from conftest import REPO
from safetensors.torch import load_file
from typer.testing import CliRunner

import cembed.train.recipe as T
from cembed.cli.app import app
from cembed.config.file import load_config
from cembed.train.checkpoint import MARKER
from cembed.train.recipe import check_run_inputs, run_training

pytestmark = pytest.mark.slow  # every test trains

STEPS = 4
# 48 rows, 6 batches of 8: the last step (4) ends mid-epoch, where the trainer's loop would go on.
ROWS = [{"anchor": f"a query about topic {i}", "positive": f"the passage on topic {i}"} for i in range(48)]
STS = [{"sentence1": f"topic {i} here", "sentence2": f"about topic {i}", "score": float(i % 5)} for i in range(10)]


def _config(folder, model_dir, name: str, **train) -> object:
    data, sts = folder / "pairs.jsonl", folder / "sts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    sts.write_text("".join(json.dumps(r) + "\n" for r in STS))
    cfg = {
        "model": {"name_or_path": str(model_dir), "device": "cpu", "max_seq_length": 32},
        "data": {"train": str(data), "pretokenize": False},
        "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 4},
        "optim": {"learning_rate": 1e-2, "lr_scaling": "none"},
        "eval": {"sts": [str(sts)]},
        "train": {"max_steps": STEPS, "logging_steps": 1, "output_dir": str(folder / name), "seed": 5, **train},
    }
    import yaml

    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _max_dw(a, b) -> float:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


@pytest.fixture(scope="module")
def straight(tiny_model_dir, tmp_path_factory):
    """The uninterrupted run (in this process): its folder and the tmp folder the other runs share."""
    folder = tmp_path_factory.mktemp("stops")
    path = _config(folder, tiny_model_dir, "straight", dataloader_num_workers=2)
    cfg = load_config(path)
    plan, data = check_run_inputs(cfg)
    summary = run_training(cfg, plan, data)
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    return folder, folder / "straight"


def _signal_at(monkeypatch, at: str, step: int, times: int = 1, delay: float = 0.0) -> None:
    """Send this process SIGTERM ``times`` times at ``at`` (``on_step_begin``: during step ``step``;
    ``on_step_end``: ``delay`` seconds after step ``step`` ended, from a timer)."""

    class Signalling(T.InterruptCallback):
        def on_step_begin(self, args, state, control, **kw):
            if at == "on_step_begin" and state.global_step + 1 == step and self.signum is None:
                for _ in range(times):
                    os.kill(os.getpid(), signal.SIGTERM)
            return control

        def on_step_end(self, args, state, control, **kw):
            out = super().on_step_end(args, state, control, **kw)
            if at == "on_step_end" and state.global_step == step:
                threading.Timer(delay, os.kill, (os.getpid(), signal.SIGTERM)).start()
            return out

    monkeypatch.setattr(T, "InterruptCallback", Signalling)


def _slow_final_save(monkeypatch, seconds: float) -> None:
    """The final model's save takes ``seconds`` longer (a real model's takes seconds to minutes)."""
    save = T.save_model_atomic

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return save(*args, **kwargs)

    monkeypatch.setattr(T, "save_model_atomic", slow)


def _train(path, *flags):
    return CliRunner().invoke(app, ["train", str(path), *flags])


def _lines(result) -> str:
    return " ".join(result.output.split())


@pytest.mark.parametrize(("when", "grace"), [("during", None), ("after", None), ("during", 0.001), ("after", 0.001)])
def test_a_sigterm_in_or_after_the_last_step_finishes_the_run_or_prints_a_command_that_does(
    straight, tiny_model_dir, monkeypatch, when, grace
):
    folder, reference = straight
    name = f"{when}-{'tight' if grace else 'default'}"
    extra = {"stop_grace_seconds": grace} if grace else {}
    path = _config(folder, tiny_model_dir, name, save_steps=2, **extra)  # checkpoints at 2 and the last step
    if when == "during":
        _signal_at(monkeypatch, "on_step_begin", STEPS)
    else:  # 0.5 s after the last step: in the final save
        _signal_at(monkeypatch, "on_step_end", STEPS, delay=0.5)
        _slow_final_save(monkeypatch, 1.5)
    r = _train(path)
    out = folder / name
    summary = json.loads((out / "run_summary.json").read_text())
    text = _lines(r)
    if grace is None:  # the run's end fits in 90 s: finished, and the summary says a signal came
        assert r.exit_code == 0, r.output
        assert summary["status"] == "completed" and summary["steps"] == STEPS
        during = f"step {STEPS}" if when == "during" else "final save"
        assert summary["stop_signal"] == {"signal": "SIGTERM", "during": during, "finished_within_s": 90.0}
        assert f"SIGTERM during {during}: the run was finished within train.stop_grace_seconds (90 s)" in text
    else:  # stopped with the last step's checkpoint; the printed command finishes the run
        assert r.exit_code == 143, r.output
        stage = "final save" if when == "during" else "evaluation"
        checkpoint = out / f"checkpoint-{STEPS}"
        assert summary["status"] == "interrupted" and summary["steps"] == STEPS, summary
        assert summary["stopped_during"] == stage and summary["checkpoint"] == str(checkpoint)
        assert (checkpoint / MARKER).exists()
        assert f"interrupted by SIGTERM after the last step ({STEPS}), before the {stage}" in text
        command = r.output.strip().splitlines()[-1]
        assert command == f"resume with: cembed train {path} --resume", r.output
        monkeypatch.undo()
        r = _train(*command.removeprefix("resume with: cembed train ").split())
        assert r.exit_code == 0, r.output
        summary = json.loads((out / "run_summary.json").read_text())
        assert summary["status"] == "completed" and summary["steps"] == STEPS
        assert summary["steps_this_run"] == 0 and summary["resumed_from"] == str(checkpoint)  # nothing trained again
        assert summary["eval"]["after"]
    d_w = _max_dw(reference, out)
    print(
        f"\nSIGTERM {when} the last step, grace {grace or 90}: exit {r.exit_code}, max|dW| vs uninterrupted {d_w:.1e}"
    )
    assert d_w <= 1e-6


def test_a_second_sigterm_in_one_process_abandons_the_step_and_says_so(straight, tiny_model_dir, monkeypatch):
    folder, _ = straight
    path = _config(folder, tiny_model_dir, "twice", save_steps=1)
    _signal_at(monkeypatch, "on_step_begin", 3, times=2)
    r = _train(path)
    out = folder / "twice"
    assert r.exit_code == 143, r.output
    last = out / "checkpoint-2"
    assert r.output.strip().splitlines()[-2:] == [
        f"abandoned step 3 (SIGTERM again): not saved; the last complete checkpoint is {last}",
        f"resume with: cembed train {path} --resume",
    ], r.output
    assert "abandoned: second SIGTERM during step 3; not saved" in (out / "train.log").read_text()
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["status"] == "abandoned" and summary["abandoned"] == "step 3" and summary["steps"] == 2
    assert summary["signal"] == "SIGTERM" and summary["last_checkpoint"] == str(last)
    assert not (out / "checkpoint-3").exists()


# During step 3 the run has `kill -<SIGNAL> -- -PGID` sent to its process group from outside it, as a
# scheduler signals every process of a job: the data-loader workers get the signal too. The step then
# goes on for a second, as a real model's does. (From outside: torch's workers end quietly on a
# SIGTERM from their parent, the main process, not on the scheduler's.)
SIGNAL_TO_THE_GROUP_AT_STEP_3 = textwrap.dedent(
    """
    import os, subprocess, sys, time
    import cembed.train.recipe as T

    SIGNAL = sys.argv.pop(1)  # TERM, USR1

    class GroupSignalAtStep3(T.InterruptCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 2 and self.signum is None:
                group = os.getpgid(0)
                subprocess.run(["kill", f"-{SIGNAL}", "--", f"-{group}"], start_new_session=True, check=True)
                time.sleep(1)
            return control

    T.InterruptCallback = GroupSignalAtStep3
    from cembed.cli.app import main
    sys.argv = ["cembed", "train", *sys.argv[1:]]
    main()
    """
)


@pytest.mark.parametrize(("name", "code"), [("TERM", 143), ("USR1", 138)])
def test_a_stop_signal_to_the_whole_process_group_with_data_loader_workers_saves_and_resumes_exactly(
    straight, tiny_model_dir, name, code
):
    folder, reference = straight
    run = f"group-{name.lower()}"
    path = _config(folder, tiny_model_dir, run, dataloader_num_workers=2)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    r = subprocess.run(
        [sys.executable, "-c", SIGNAL_TO_THE_GROUP_AT_STEP_3, name, str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        start_new_session=True,  # its own process group: the signal reaches it and its workers only
    )
    out = folder / run
    assert r.returncode == code, r.stdout[-2000:] + r.stderr[-3000:]  # 128 + the signal
    assert (out / "checkpoint-3" / MARKER).exists()
    assert r.stderr.splitlines()[-2:] == [
        f"interrupted by SIG{name} at step 3: checkpoint saved to {out / 'checkpoint-3'}",
        f"resume with: cembed train {path} --resume",
    ], r.stderr
    resumed = _train(path, "--resume")
    assert resumed.exit_code == 0, resumed.output
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["status"] == "completed" and summary["resumed_from"] == str(out / "checkpoint-3")
    d_w = _max_dw(reference, out)
    print(f"\nSIG{name} to the process group at step 3 (2 data-loader workers), resumed: max|dW| {d_w:.1e}")
    assert d_w <= 1e-6
