"""A hung rank: the job ends with a one-line error within the process-group timeout, and no rank
process is left behind (issue 32 item 8).

Rank 1 is made to hang (sleep, as a rank stuck in I/O or a deadlock would) at its first training
step by a plugin (``cembed.plugins`` entry point, installed into a temporary site folder the ranks
see through ``PYTHONPATH``): cembed's production code carries no test hook. Rank 0 goes on into the
step's collectives and waits there ``distributed.timeout_minutes``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, distinct_pairs, install_distribution

pytestmark = pytest.mark.slow  # starts a 2-rank job

TIMEOUT_MIN = 0.25  # 15 s: the collective timeout the job must honour (and start-up on a loaded machine)
MARGIN_S = 20  # rank 0's error, the launcher stopping rank 1, the ranks' exit (on 2 busy CPU cores)

# Rank 1 writes its pid and, when it starts hanging, the time; rank 0 writes its pid.
HANG_PLUGIN = """
import os, time
from pathlib import Path

def register():
    rank = os.environ.get("RANK")
    if rank is None:  # the launching process: nothing to do
        return
    marks = Path(os.environ["CEMBED_TEST_HANG_DIR"])
    (marks / f"pid{rank}").write_text(str(os.getpid()))
    if rank != "1":
        return
    from cembed.train.trainer import CembedTrainer

    def hang(self, *args, **kwargs):
        (marks / "hang_started").write_text(repr(time.time()))
        while True:
            time.sleep(1)

    CembedTrainer.training_step = hang
"""


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_a_hung_rank_ends_the_job_with_one_line_within_the_timeout(tiny_model_dir, write_config, pairs_file, tmp_path):
    site = install_distribution(
        tmp_path / "site",
        "cembed-test-hang",
        {"hang_plugin.py": HANG_PLUGIN},
        {"cembed.plugins": {"hang": "hang_plugin:register"}},
    )
    marks = tmp_path / "marks"
    marks.mkdir()
    cfg = write_config(
        {
            "model": {"name_or_path": str(tiny_model_dir), "max_seq_length": 32, "device": "cpu"},
            "data": {"train": str(pairs_file(distinct_pairs(40))), "cache_dir": str(tmp_path / "cache")},
            "batch": {"per_device_train_batch_size": 4, "mini_batch_size": 2},
            "train": {"max_steps": 2, "output_dir": str(tmp_path / "run")},
            "distributed": {"timeout_minutes": TIMEOUT_MIN},
        }
    )
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPO}", "CEMBED_TEST_HANG_DIR": str(marks)}
    start = time.time()
    r = subprocess.run(
        [sys.executable, "-m", "cembed", "train", str(cfg), "--nproc-per-node", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    end = time.time()
    out = r.stdout + r.stderr
    started = sorted(p.name for p in marks.iterdir())
    assert {"pid0", "pid1", "hang_started"} <= set(started), (started, out)  # both ranks reached training
    pids = [int((marks / f"pid{rank}").read_text()) for rank in (0, 1)]
    survivors = [pid for pid in pids if _alive(pid)]
    for pid in survivors:  # leave nothing running whatever the assertions say
        os.kill(pid, 9)
    hang_started = float((marks / "hang_started").read_text())
    print(f"job {end - start:.1f} s, hang to end {end - hang_started:.1f} s, exit {r.returncode}\n{out}")
    assert not survivors, out
    assert r.returncode == 1, out
    assert end - hang_started < TIMEOUT_MIN * 60 + MARGIN_S, out
    assert "Traceback" not in out, out
    cause = f"a collective timed out after {TIMEOUT_MIN * 60:g} s on rank 0 in step 1: another rank did not reach it"
    job_errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(job_errors) == 1 and job_errors[0].startswith(f"error: rank 0 failed (exit code 3): {cause}"), out
    assert "raise distributed.timeout_minutes" in job_errors[0] and "RunFailed" not in job_errors[0], out
    # Besides the job's line, only rank 0's own one-line report (its log on a node of its own).
    others = [line for line in out.splitlines() if "error" in line.lower() and line not in job_errors]
    assert all(line.startswith(f"[rank 0] error: {cause}") for line in others), out
