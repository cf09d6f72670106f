"""Runs that outlive their machines (issue 33 item 3), through the launcher (``cembed train
--nproc-per-node 2``, 2 gloo ranks):

- SIGTERM to every process of the job, as Slurm sends it (the launcher, both ranks and their two
  data-loader workers each; issue 38): every rank finishes its step and saves the same complete
  checkpoint (the workers ignore the signal, a rank takes the launcher's forward of it for the same
  one), the job exits 143 (128 + SIGTERM), and ``--resume`` ends with the uninterrupted run's weights.
  SIGUSR1 (Slurm's ``--signal=USR1@120``) the same, exit 138.
- A second SIGTERM while the ranks finish their step: they stop at once without saving it, the
  job exits 143 saying so, and the newest checkpoint is the one before; ``train.log`` and
  ``run_summary.json`` (status ``abandoned``) say which step.
- ``--max-restarts 2``: a rank killed (SIGKILL) mid-run restarts the job once, which says so
  (``restart 1 of 2: resuming from checkpoint-S (rank 1 killed by SIGKILL)``), resumes from the newest
  complete checkpoint by itself and exits 0 with the uninterrupted run's weights; the summary records
  the restart. (Before cembed's launcher gave each restart a store of its own, the restarted ranks
  hung or failed to connect: cembed.distributed.launch.FRESH_STORE_PER_RESTART.)

The signals land wherever the run is (after its first checkpoint): the comparison holds for any step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO

pytestmark = pytest.mark.slow  # each test launches 2 worker processes

STEPS = 12  # the signals land at step 3 or so (after checkpoint-2): room to spare under load


def _config(write_config, tmp: Path, model_dir: Path, out: str) -> Path:
    data = tmp / "pairs.jsonl"
    if not data.exists():
        rows = [{"anchor": f"a query about topic {i}", "positive": f"the passage on topic {i}"} for i in range(32)]
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return write_config(
        {
            "model": {"name_or_path": str(model_dir), "max_seq_length": 32, "device": "cpu"},
            "data": {"train": str(data), "cache_dir": str(tmp / "cache")},
            "batch": {"global_batch_size": 8, "mini_batch_size": 4},
            "optim": {"learning_rate": 1e-2, "lr_scaling": "none", "warmup_ratio": 0.25},
            "train": {
                "max_steps": STEPS,
                "save_steps": 2,
                "logging_steps": 1,
                "output_dir": str(tmp / out),
                "dataloader_num_workers": 2,  # as on any machine with cores to spare: a scheduler signals them too
            },
        },
        name=f"{out}.yaml",
    )


def _launch(cfg: Path, *flags: str, env_extra: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", **(env_extra or {})}
    cmd = [sys.executable, "-m", "cembed", "train", str(cfg), "--nproc-per-node", "2", *flags]
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a job of its own, as a scheduler starts it
    )


def _wait_for_checkpoint(out: Path, proc: subprocess.Popen, step: int = 2, timeout: float = 300) -> None:
    marker = out / f"checkpoint-{step}" / "cembed_checkpoint_complete.json"
    end = time.monotonic() + timeout
    while not marker.exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < end, "no checkpoint in time"
        time.sleep(0.02)


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _max_dw(a: Path, b: Path) -> float:
    wa, wb = _weights(a), _weights(b)
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory):
    import yaml

    tmp = tmp_path_factory.mktemp("preempt")

    def write_config(cfg: dict, name: str) -> Path:
        (tmp / name).write_text(yaml.safe_dump(cfg, sort_keys=False))
        return tmp / name

    cfg = _config(write_config, tmp, tiny_model_dir, "straight")
    proc = _launch(cfg)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    return tmp, write_config, tmp / "straight"


def _signal_every_process(launcher: subprocess.Popen, signum: int) -> int:
    """Send ``signum`` to every process of the launched job, as Slurm does: the launcher's process group
    and each rank's (torch starts each rank in a session of its own, with its data-loader workers).
    Returns how many processes were signalled."""
    import psutil

    ranks = [p for p in psutil.Process(launcher.pid).children() if "cembed" in " ".join(p.cmdline())]
    count = sum(1 + len(p.children(recursive=True)) for p in ranks) + 1
    os.killpg(launcher.pid, signum)
    for rank in ranks:
        os.killpg(rank.pid, signum)
    return count


def test_sigterm_to_every_process_saves_every_rank_and_resume_equals_uninterrupted(uninterrupted, tiny_model_dir):
    tmp, write_config, straight = uninterrupted
    cfg = _config(write_config, tmp, tiny_model_dir, "preempted")
    out = tmp / "preempted"
    proc = _launch(cfg)
    _wait_for_checkpoint(out, proc)
    signalled = _signal_every_process(proc, signal.SIGTERM)
    assert signalled >= 3  # the launcher, 2 ranks and their data-loader workers (2 each while an epoch runs)
    text, _ = proc.communicate(timeout=300)
    assert proc.returncode == 143, text  # 128 + SIGTERM
    summary = json.loads((out / "run_summary.json").read_text())
    step = summary["steps"]
    assert summary["status"] == "interrupted" and 2 <= step < STEPS, summary
    checkpoint = out / f"checkpoint-{step}"
    assert summary["checkpoint"] == str(checkpoint)
    marker = json.loads((checkpoint / "cembed_checkpoint_complete.json").read_text())
    assert marker["step"] == step
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= {p.name for p in checkpoint.iterdir()}  # both ranks saved it
    assert f"interrupted by SIGTERM: newest checkpoint {checkpoint}" in " ".join(text.split()), text
    assert "--resume" in text and "Traceback" not in text
    resumed = _launch(cfg, "--resume")
    text, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, text
    d_w = _max_dw(straight, out)
    print(f"\nSIGTERM to {signalled} processes at step {step}, resumed: max|dW| vs uninterrupted {d_w:.2e}")
    assert d_w <= 1e-6


def test_sigusr1_to_every_process_saves_every_rank_as_sigterm_does(uninterrupted, tiny_model_dir):
    """Slurm's --signal=USR1@120 (submitit's default) signals every process of the job step: the
    launcher forwards SIGUSR1 as it does SIGTERM and every rank saves the same checkpoint, exit 138
    (128 + SIGUSR1). Before, the launcher, the ranks and their workers died of it, nothing saved. The
    resume of such a checkpoint is the SIGTERM test's (the same checkpoint, the same code)."""
    tmp, write_config, _ = uninterrupted
    cfg = _config(write_config, tmp, tiny_model_dir, "usr1")
    out = tmp / "usr1"
    proc = _launch(cfg)
    _wait_for_checkpoint(out, proc)
    _signal_every_process(proc, signal.SIGUSR1)
    text, _ = proc.communicate(timeout=300)
    assert proc.returncode == 138, text
    summary = json.loads((out / "run_summary.json").read_text())
    step = summary["steps"]
    assert summary["status"] == "interrupted" and 2 <= step < STEPS, summary
    checkpoint = out / f"checkpoint-{step}"
    assert json.loads((checkpoint / "cembed_checkpoint_complete.json").read_text())["step"] == step
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= {p.name for p in checkpoint.iterdir()}  # both ranks saved it
    assert f"interrupted by SIGUSR1: newest checkpoint {checkpoint}" in " ".join(text.split()), text
    assert "--resume" in text and "Traceback" not in text


def _workers(launcher: int) -> list:
    """The launcher's worker processes (psutil.Process)."""
    import psutil

    return [p for p in psutil.Process(launcher).children() if "cembed" in " ".join(p.cmdline())]


def test_max_restarts_resumes_a_killed_rank_from_the_newest_checkpoint(uninterrupted, tiny_model_dir):
    tmp, write_config, straight = uninterrupted
    cfg = _config(write_config, tmp, tiny_model_dir, "restarted")
    out = tmp / "restarted"
    proc = _launch(cfg, "--max-restarts", "2")
    _wait_for_checkpoint(out, proc)
    workers = _workers(proc.pid)
    assert len(workers) == 2
    rank = int(workers[-1].environ()["RANK"])
    workers[-1].send_signal(signal.SIGKILL)
    text, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, text
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    resumed_from = summary["resumed_from"]
    assert resumed_from and Path(resumed_from).parent == out, summary  # the restart resumed by itself
    name = Path(resumed_from).name
    restart = f"restart 1 of 2: resuming from {name} (rank {rank} killed by SIGKILL)"
    assert restart in text and "restart 2 of 2" not in text, text  # restarted once, and said so
    assert summary["restarts"] == [
        {"restart": 1, "of": 2, "resumed_from": name, "reason": f"rank {rank} killed by SIGKILL"}
    ]
    d_w = _max_dw(straight, out)
    print(f"\nSIGKILL of a rank, restarted from {name}: max|dW| vs uninterrupted {d_w:.2e}")
    assert d_w <= 1e-6


# Loaded by every process of the launched job (a sitecustomize on PYTHONPATH): after the first signal,
# each worker's step end waits, so that the second signal lands while the step is being finished.
SLOW_STOP = """
import os, time
if os.environ.get("TORCHELASTIC_RUN_ID"):  # the launcher's workers
    from cembed.train import checkpoint

    finish = checkpoint.InterruptCallback.on_step_end

    def on_step_end(self, *args, **kwargs):
        control = finish(self, *args, **kwargs)
        if self.signum is not None:
            time.sleep(30)
        return control

    checkpoint.InterruptCallback.on_step_end = on_step_end
"""


def test_a_second_sigterm_to_the_launcher_abandons_the_step_without_saving(uninterrupted, tiny_model_dir):
    import threading

    tmp, write_config, _ = uninterrupted
    cfg = _config(write_config, tmp, tiny_model_dir, "abandoned")
    out = tmp / "abandoned"
    site = tmp / "slow_stop"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SLOW_STOP)
    path = os.pathsep.join(p for p in (str(site), str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    proc = _launch(cfg, env_extra={"PYTHONPATH": path})
    _wait_for_checkpoint(out, proc)
    lines: list[str] = []
    shutting_down = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "shutting down workers" in line:  # torch's agent forwarded the first signal
                shutting_down.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    proc.send_signal(signal.SIGTERM)
    assert shutting_down.wait(120), "".join(lines)
    time.sleep(2)  # the workers now wait at their step end (SLOW_STOP), before its save
    from cembed.train.checkpoint import latest_complete

    before = latest_complete(out)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) == 143, "".join(lines)  # 128 + SIGTERM, well before SLOW_STOP's 30 s end
    reader.join(30)
    text = " ".join("".join(lines).split())
    assert before is not None and latest_complete(out) == before  # the abandoned step saved nothing
    summary = json.loads((out / "run_summary.json").read_text())
    step = summary["steps"]  # trained, its checkpoint abandoned (the second signal came during the stop's save)
    assert summary["status"] == "abandoned" and summary["abandoned"] == f"step {step}", summary
    assert f"abandoned: second SIGTERM during step {step}; not saved" in (out / "train.log").read_text()
    assert f"abandoned step {step} (SIGTERM again): not saved; the last complete checkpoint is {before}" in text
    assert text.count("abandoned step") == 1  # the launcher's line; rank 0 does not print it again
    assert "--resume" in text and "Traceback" not in text
