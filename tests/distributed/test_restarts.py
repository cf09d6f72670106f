"""``--max-restarts`` restarts only where a restart can help (issue 38 item 4).

torch's elastic agent restarts the workers after any failure; cembed's (:class:`cembed.distributed.launch.RestartPolicy`)
not after a user error (exit code 2: a config or data mistake, the same on every attempt), which
ends the job at once with its one line. A crash, a killed rank or a collective timeout is restarted,
each restart announced (``restart k of N: resuming from checkpoint-S (reason)``) and recorded in
``run_summary.json``. The killed-rank restart runs in tests/distributed/test_preemption.py; here the
policy and its agent by hand, a worker's restart flags, and two launched jobs with a data mistake:
a bad file found while loading, and a null cell of a stream met at a later step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import REPO
from typer.testing import CliRunner

from cembed.distributed.launch import RESTARTS_ENV, RestartPolicy, policy_agent, restartable, restarts_record
from cembed.errors import UserError
from cembed.train.checkpoint import mark_complete


def test_a_user_error_is_not_restarted_a_crash_a_kill_or_a_timeout_is(monkeypatch):
    monkeypatch.delenv(RESTARTS_ENV, raising=False)
    lines = []
    point = ["checkpoint-4"]
    policy = RestartPolicy(2, resume_point=lambda: point[0], announce=lines.append)
    assert [restartable(code) for code in (2, 1, 3, -9, -15)] == [False, True, True, True, True]
    assert not policy.restart(0, 2, "UserError: pairs.jsonl: invalid JSON on line 3")
    assert policy.refused == "rank 0 exited with code 2: UserError: pairs.jsonl: invalid JSON on line 3"
    assert lines == [] and policy.restarts == [] and RESTARTS_ENV not in os.environ
    assert policy.restart(1, -9, "Signal 9 (SIGKILL) received by PID 42")
    point[0] = None  # no complete checkpoint yet
    timeout = "RunFailed: a collective timed out after 600 s on rank 0 in step 5: another rank did not reach it\nmore"
    assert policy.restart(0, 3, timeout)
    assert lines == [
        "restart 1 of 2: resuming from checkpoint-4 (rank 1 killed by SIGKILL)",
        "restart 2 of 2: starting again (no checkpoint yet) (rank 0 exited with code 3: RunFailed: a collective timed "
        "out after 600 s on rank 0 in step 5: another rank did not reach it)",
    ]
    assert not policy.restart(0, 1, "")  # none left
    # the restarted workers inherit the record, and run_summary.json holds it
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert restarts_record() == json.loads(os.environ[RESTARTS_ENV]) == policy.restarts
    assert restarts_record()[0] == {
        "restart": 1,
        "of": 2,
        "resumed_from": "checkpoint-4",
        "reason": "rank 1 killed by SIGKILL",
    }
    monkeypatch.delenv(RESTARTS_ENV)  # torchrun by hand: the count only
    assert restarts_record() == [{"restart": k, "of": None, "resumed_from": None, "reason": None} for k in (1, 2)]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert restarts_record() == []


def test_the_agent_asks_the_policy_before_it_restarts(monkeypatch):
    """cembed's agent is torch's LocalElasticAgent whose failed-group check ends the restarts after a
    user error (the agent then stops the workers and reports the failure, as with none left)."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    policy = RestartPolicy(3)
    agent_cls = policy_agent(policy)
    assert issubclass(agent_cls, LocalElasticAgent)
    failures: dict = {}
    monkeypatch.setattr(
        LocalElasticAgent, "_monitor_workers", lambda self, group: RunResult(WorkerState.FAILED, failures=failures)
    )
    agent = object.__new__(agent_cls)  # (no process group, no rendezvous: only the check)
    agent._remaining_restarts = 3
    failures.update(
        {0: SimpleNamespace(exitcode=-9, message="", timestamp=2), 1: SimpleNamespace(exitcode=1, timestamp=1)}
    )
    failures[1].message = {"message": "RuntimeError: boom", "extraInfo": {}}
    agent._monitor_workers(None)
    assert (
        agent._remaining_restarts == 3
        and policy.restarts[0]["reason"] == "rank 1 exited with code 1: RuntimeError: boom"
    )
    failures.clear()
    failures.update({0: SimpleNamespace(exitcode=2, message={"message": "UserError: bad"}, timestamp=5)})
    agent._monitor_workers(None)
    assert agent._remaining_restarts == 0 and policy.refused == "rank 0 exited with code 2: UserError: bad"
    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", lambda self, group: RunResult(WorkerState.HEALTHY))
    agent._remaining_restarts = 1
    agent._monitor_workers(None)
    assert agent._remaining_restarts == 1 and len(policy.restarts) == 1  # a healthy group: nothing asked


def _asked_resume(monkeypatch, path, counts: dict[str, int]) -> list[tuple]:
    """Train ``path`` through the CLI with each of ``counts`` (a name -> (this worker's
    ``$TORCHELASTIC_RESTART_COUNT``, the largest over the job's ranks)); return the ``(resume,
    resume_from)`` the run's output folder was prepared with, for each. The ranks' maximum is faked
    (the collective returns it), and the run stops there."""
    import cembed.distributed.collectives
    import cembed.train.facts
    import cembed.train.recipe
    from cembed.cli.app import app

    asked = []

    def prepare_output(output_dir, max_steps, plan, resume, resume_from, overwrite, record=None):
        asked.append((resume, resume_from))
        raise UserError("stop here")

    plan = SimpleNamespace(
        device="cpu", samples_per_step=8, learning_rate=1e-3, precision="fp32", world_size=2, contrast_rows=8
    )
    monkeypatch.setattr(cembed.train.recipe, "check_run_inputs", lambda cfg: (plan, SimpleNamespace(dataset=None)))
    monkeypatch.setattr(cembed.train.facts, "run_facts", lambda *args: SimpleNamespace(warnings=()))
    monkeypatch.setattr(cembed.train.recipe, "training_record", lambda *args, **kwargs: {})
    monkeypatch.setattr(cembed.train.recipe, "prepare_output", prepare_output)
    for own, job in counts.values():
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(own))
        monkeypatch.setattr(cembed.distributed.collectives, "max_over_ranks", lambda value, job=job: max(value, job))
        r = CliRunner().invoke(app, ["train", str(path)])
        assert r.exit_code == 2 and "stop here" in r.output, r.output
    return asked


def test_a_restarted_worker_resumes_from_the_newest_complete_checkpoint_without_a_flag(
    write_config, pairs_file, tmp_path, monkeypatch
):
    """The worker of a restart (TORCHELASTIC_RESTART_COUNT > 0) trains with --resume though its command
    line has none; the first attempt as asked. pytorch/pytorch#108158: torch's agent counts a restart
    on the failed worker's node only; the other nodes' agents restart their healthy workers with a
    count of 0. Such a worker (0 here, 1 on another rank) resumes too, with the job: before, it started
    afresh (here: refused, the folder holding the failed attempt's checkpoint) while the failed node's
    workers resumed."""
    out = tmp_path / "out"
    (out / "checkpoint-2").mkdir(parents=True)
    mark_complete(out / "checkpoint-2", 2)
    path = write_config(
        {"data": {"train": str(pairs_file([{"anchor": "a", "positive": "b"}]))}, "train": {"output_dir": str(out)}}
    )
    counts = {"first attempt": (0, 0), "restarted here": (1, 1), "healthy node's worker restarted": (0, 1)}
    assert _asked_resume(monkeypatch, path, counts) == [(False, None), (True, None), (True, None)]


# --- launched jobs: one process through the launcher (--max-restarts without --nproc-per-node) ------

# Loaded by every process of the job (a sitecustomize on PYTHONPATH): the stream is read 16 rows at a
# time (the default 4096 would read the whole test file before the first step).
SMALL_READS = """
import functools
from cembed.data.batching import stream

stream.StreamingSource.__init__ = functools.partialmethod(stream.StreamingSource.__init__, read_rows=16)
"""


def _launch(cfg: Path, tmp: Path, *flags: str) -> subprocess.CompletedProcess:
    site = tmp / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SMALL_READS)
    path = os.pathsep.join(p for p in (str(site), str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "cembed", "train", str(cfg), *flags]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def _attempts(result: subprocess.CompletedProcess) -> int:
    """How many times the launcher started the worker (torch's agent logs each failed attempt)."""
    return (result.stdout + result.stderr).count("failed (exitcode:")


@pytest.mark.slow
@pytest.mark.parametrize("mistake", ["bad file", "stream row at a later step"])
def test_a_data_mistake_ends_the_job_at_once_with_its_one_line(tiny_model_dir, tmp_path, write_config, mistake):
    rows = [{"anchor": f"a query about topic {i}", "positive": f"the passage on topic {i}"} for i in range(96)]
    data = tmp_path / "pairs.jsonl"
    lines = [json.dumps(r) for r in rows]
    train: dict = {"path": str(data)}
    if mistake == "bad file":
        lines[2] = '{"anchor": "e", "positive": '
        expected = f"{data}: invalid JSON on line 3"
    else:  # a null cell at row 80, past the rows checked before training (check_rows): met at a later step
        lines[80] = json.dumps({"anchor": "a query about topic 80", "positive": None})
        train["streaming"] = {"check_rows": 16}
        expected = f"{data}: a row has no 'positive' (null cell)"
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    cfg = write_config(
        {
            "model": {"name_or_path": str(tiny_model_dir), "device": "cpu", "max_seq_length": 32},
            "data": {"train": train, "pretokenize": False},
            "batch": {"per_device_train_batch_size": 8, "mini_batch_size": 8},
            "train": {"max_steps": 12, "save_steps": 2, "logging_steps": 1, "output_dir": str(out)},
        }
    )
    r = _launch(cfg, tmp_path, "--max-restarts", "2")
    text = r.stdout + r.stderr
    assert r.returncode == 2, text
    assert _attempts(r) == 1 and "restart 1 of 2" not in text, text
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(f"error: rank 0 failed (exit code 2): {expected}"), text
    assert errors[0].endswith(
        "; the other processes were stopped; not restarted: a user error fails every attempt alike"
    )
    assert text.count(expected) == 1, text  # one line: the worker does not print it again
    if mistake != "bad file":  # the stream failed after some steps: their checkpoints are there
        assert (out / "checkpoint-2").is_dir(), text


def test_the_launcher_gives_signalled_workers_train_stop_grace_seconds_before_sigkill(
    tiny_model_dir, write_config, pairs_file, monkeypatch
):
    """pytorch/pytorch#119856: torchrun SIGKILLs its workers 30 s after forwarding a SIGTERM, while
    Slurm's --signal=TERM@120 leaves minutes for a step and a save. ``cembed train --nproc-per-node``
    hands torch's launcher ``train.stop_grace_seconds`` (rounded up) as its shutdown timeout; the
    reference is torch's own reading of the arguments (``config_from_args``), with no
    ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` set, and a value set by the user is kept."""
    import torch.distributed.run as torchrun

    from cembed.cli.app import app

    seen = []
    monkeypatch.setattr(torchrun, "run", lambda args: seen.append(torchrun.config_from_args(args)[0].shutdown_timeout))
    for name in ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "CEMBED_LAUNCHER", "PYTHONFAULTHANDLER", RESTARTS_ENV):
        monkeypatch.setenv(name, "")  # restored (to unset) after the test: launch() sets them
        monkeypatch.delenv(name)
    rows = [{"anchor": f"question {i}", "positive": f"answer {i}"} for i in range(16)]
    path = write_config(
        {
            "model": {"name_or_path": str(tiny_model_dir), "device": "cpu"},
            "data": {"train": str(pairs_file(rows))},
            "batch": {"global_batch_size": 8, "mini_batch_size": 4},
            "train": {"stop_grace_seconds": 149.5},
        }
    )
    r = CliRunner().invoke(app, ["train", str(path), "--nproc-per-node", "2"])
    assert r.exit_code == 0, r.output
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "600")  # the user's own
    r = CliRunner().invoke(app, ["train", str(path), "--nproc-per-node", "2"])
    assert r.exit_code == 0, r.output
    assert seen == [150, 600]
