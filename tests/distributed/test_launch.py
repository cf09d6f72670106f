"""Starting a multi-process job (cembed/distributed/launch.py): the launcher's command line, a failed
worker in a few words, the restart record the workers read, a worker's error for the launcher, and
``launch`` around torch's launcher (its ``run`` replaced: no process is started here; the real
launches are in tests/distributed/test_distributed.py, test_restarts.py and test_preemption.py)."""

from __future__ import annotations

import json
import os
import signal
from types import SimpleNamespace

import pytest

from cembed.distributed.launch import (
    FRESH_STORE_PER_RESTART,
    LAUNCHED_BY_CEMBED,
    RESTARTS_ENV,
    RestartPolicy,
    failure_reason,
    launch,
    launched_by_cembed,
    launcher_args,
    record_worker_error,
    restart_count,
    restarts_record,
)
from cembed.errors import LauncherSignalled, UserError, WorkerFailed

# what launch() sets for its workers; each test starts without them and leaves none behind
LAUNCH_ENV = (
    "PYTHONFAULTHANDLER",
    LAUNCHED_BY_CEMBED,
    RESTARTS_ENV,
    "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
    FRESH_STORE_PER_RESTART[0],
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_ERROR_FILE",
)


@pytest.fixture(autouse=True)
def _environment():
    saved = dict(os.environ)
    for name in LAUNCH_ENV:
        os.environ.pop(name, None)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_launcher_args_are_torchruns_command_line():
    assert launcher_args("cembed", ["train", "c.yaml"], 2) == [
        *("--nproc-per-node", "2", "--nnodes", "1", "--node-rank", "0"),
        *("--module", "cembed", "train", "c.yaml"),
    ]
    assert launcher_args("cembed", ["train", "c.yaml"], 4, 2, 1, "node0:29400", max_restarts=3) == [
        *("--nproc-per-node", "4", "--nnodes", "2", "--node-rank", "1"),
        *("--rdzv-endpoint", "node0:29400", "--max-restarts", "3", "--rdzv-backend", "c10d"),
        *("--module", "cembed", "train", "c.yaml"),
    ]
    # torchrun's static rendezvous unless restarts cross nodes: one node with restarts, nodes without
    assert launcher_args("cembed", [], 4, 1, 0, None, max_restarts=3)[-4:] == [
        "--max-restarts",
        "3",
        "--module",
        "cembed",
    ]
    assert "--rdzv-backend" not in launcher_args("cembed", [], 4, 2, 1, "node0:29400")
    # the smallest counts are allowed: one process, one node, node rank 0
    assert launcher_args("m", [], 1, 1, 0)[:6] == ["--nproc-per-node", "1", "--nnodes", "1", "--node-rank", "0"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_restarts": -1}, "--max-restarts -1: give 0 (no restart) or more"),
        ({"nproc_per_node": 0}, "--nproc-per-node 0: give at least 1 process per node"),
        ({"nnodes": 0}, "--nnodes 0: give at least 1 node"),
        (
            {"nnodes": 2, "node_rank": 2, "rdzv_endpoint": "h:1"},
            "--node-rank 2: must be between 0 and --nnodes - 1 (1)",
        ),
        (
            {"nnodes": 2, "node_rank": -1, "rdzv_endpoint": "h:1"},
            "--node-rank -1: must be between 0 and --nnodes - 1 (1)",
        ),
        (
            {"nnodes": 2, "node_rank": 1},
            "--nnodes 2: also give --rdzv-endpoint HOST:PORT, the address of node 0 that every node can reach",
        ),
    ],
)
def test_launcher_args_refuse_impossible_counts_naming_the_flag(kwargs, message):
    args = {"nproc_per_node": 2, **kwargs}
    with pytest.raises(UserError) as err:
        launcher_args("cembed", [], **args)
    assert str(err.value) == message


def test_a_failed_worker_in_a_few_words():
    assert failure_reason(1, -9, "Signal 9 (SIGKILL) received by PID 42") == "rank 1 killed by SIGKILL"
    assert failure_reason(0, -15, None) == "rank 0 killed by SIGTERM"
    assert failure_reason(3, -200, None) == "rank 3 killed by signal 200"  # no such signal name
    assert failure_reason(0, 3, "\n  RunFailed: a collective timed out\nmore") == (
        "rank 0 exited with code 3: RunFailed: a collective timed out"
    )
    assert failure_reason(2, 1, None) == "rank 2 exited with code 1"
    assert failure_reason(2, 1, "  \n ") == "rank 2 exited with code 1"
    assert failure_reason(0, 1, "x" * 300) == "rank 0 exited with code 1: " + "x" * 200


def test_a_policy_without_a_resume_point_or_announcer_starts_again_quietly():
    policy = RestartPolicy(1)
    assert policy.restart(0, 1, "RuntimeError: boom")
    assert policy.restarts == [
        {"restart": 1, "of": 1, "resumed_from": None, "reason": "rank 0 exited with code 1: RuntimeError: boom"}
    ]
    assert json.loads(os.environ[RESTARTS_ENV]) == policy.restarts and policy.refused is None


def test_the_restart_count_and_record_the_workers_read(monkeypatch):
    assert (restart_count(), restarts_record()) == (0, [])
    for value, count in (("3", 3), ("", 0), ("two", 0)):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", value)
        assert restart_count() == count
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    unknown = [{"restart": 1, "of": None, "resumed_from": None, "reason": None}]
    assert restarts_record() == unknown  # torchrun by hand: the count only
    entry = {"restart": 1, "of": 2, "resumed_from": "checkpoint-4", "reason": "rank 1 killed by SIGKILL"}
    for recorded, expected in (
        (json.dumps([entry]), [entry]),
        ("", unknown),
        ("not json", unknown),
        (json.dumps({"restart": 1}), unknown),  # not a list
        (json.dumps([entry, entry]), unknown),  # another count than the launcher's
    ):
        monkeypatch.setenv(RESTARTS_ENV, recorded)
        assert restarts_record() == expected, recorded


def test_a_workers_error_is_written_where_the_launcher_reads_it(monkeypatch, tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    assert record_worker_error(UserError("bad row")) is False  # outside a launcher: nothing written
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    assert record_worker_error(UserError("pairs.jsonl: invalid JSON on line 3")) is False  # torchrun by hand
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(error_file))
    assert failure.message["message"] == "UserError: pairs.jsonl: invalid JSON on line 3"
    error_file.unlink()
    assert not launched_by_cembed()
    monkeypatch.setenv(LAUNCHED_BY_CEMBED, "1")
    assert launched_by_cembed()
    assert record_worker_error(RuntimeError("boom")) is True  # cembed's launcher shows it
    assert ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file)).message["message"] == (
        "RuntimeError: boom"
    )
    monkeypatch.setenv(LAUNCHED_BY_CEMBED, "yes")
    assert not launched_by_cembed()


def _fake_run(monkeypatch, effect=None):
    """Replace torch's launcher: it records what it was started with (its arguments, the environment
    the workers would inherit, the agent class it would build) and then runs ``effect``."""
    import torch.distributed.launcher.api as launcher_api
    import torch.distributed.run

    seen = {}

    def run(args):
        seen.update(args=args, env=dict(os.environ), agent=launcher_api.LocalElasticAgent)
        if effect is not None:
            effect(launcher_api.LocalElasticAgent)

    monkeypatch.setattr(torch.distributed.run, "run", run)
    return seen


def test_launch_runs_torchs_launcher_with_the_workers_environment(monkeypatch):
    import torch.distributed.launcher.api as launcher_api

    torchs_agent = launcher_api.LocalElasticAgent
    seen = _fake_run(monkeypatch)
    os.environ[RESTARTS_ENV] = "[]"  # a previous launch's record in this process
    launch(["train", "c.yaml"], 2)
    args, env = seen["args"], seen["env"]
    assert (args.nproc_per_node, args.nnodes, args.node_rank, args.max_restarts) == ("2", "1", 0, 0)
    assert (args.module, args.training_script, args.training_script_args) == (True, "cembed", ["train", "c.yaml"])
    assert (env["PYTHONFAULTHANDLER"], env[LAUNCHED_BY_CEMBED]) == ("1", "1")
    for name in (RESTARTS_ENV, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", FRESH_STORE_PER_RESTART[0]):
        assert name not in env, name
    assert seen["agent"] is torchs_agent  # no restarts: torch's own agent
    # what the user set is kept; the shutdown wait is passed on
    os.environ.update(PYTHONFAULTHANDLER="0", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="5")
    launch(["train"], 2, module="other", shutdown_timeout_s=200)
    assert (seen["env"]["PYTHONFAULTHANDLER"], seen["env"]["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) == ("0", "5")
    assert seen["args"].training_script == "other"
    del os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]
    launch(["train"], 2, shutdown_timeout_s=200)
    assert seen["env"]["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "200"
    # several nodes: node 0's address is passed on
    launch(["train"], 2, nnodes=2, node_rank=1, rdzv_endpoint="node0:29400")
    assert (seen["args"].nnodes, seen["args"].node_rank, seen["args"].rdzv_endpoint) == ("2", 1, "node0:29400")
    # a policy without --max-restarts changes nothing
    launch(["train"], 2, policy=RestartPolicy(0))
    assert seen["agent"] is torchs_agent and FRESH_STORE_PER_RESTART[0] not in seen["env"]


def test_the_launcher_forwards_sigusr1_and_leaves_sighup_ignored_under_nohup(monkeypatch, sighup_default):
    """Slurm's --signal=USR1@120 and submitit send SIGUSR1: torch's launcher handles only SIGTERM, SIGINT,
    SIGHUP and SIGQUIT by default, and died of it at once, its workers unsaved."""
    seen = _fake_run(monkeypatch)
    monkeypatch.delenv("PET_SIGNALS_TO_HANDLE", raising=False)
    launch(["train"], 2)
    assert seen["args"].signals_to_handle.split(",") == ["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1"]
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup starts it
    try:
        launch(["train"], 2)
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert seen["args"].signals_to_handle.split(",") == ["SIGTERM", "SIGINT", "SIGQUIT", "SIGUSR1"]
    monkeypatch.setenv("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGUSR2")  # torchrun's own variable: the user's list
    launch(["train"], 2)
    assert seen["args"].signals_to_handle == "SIGTERM,SIGUSR2"


def test_launch_with_restarts_puts_cembeds_agent_in_for_the_launch(monkeypatch):
    import torch.distributed.launcher.api as launcher_api
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    torchs_agent = launcher_api.LocalElasticAgent
    failures = {1: SimpleNamespace(exitcode=-9, message="", timestamp=1)}
    monkeypatch.setattr(
        LocalElasticAgent, "_monitor_workers", lambda self, group: RunResult(WorkerState.FAILED, failures=failures)
    )

    def restart_once_then_fail(agent_cls):
        agent = object.__new__(agent_cls)  # the launch's agent, asked once about a killed rank 1
        agent._remaining_restarts = 2
        agent._monitor_workers(None)
        assert agent._remaining_restarts == 2  # restarted: the policy (default: any failure but a user error)
        failed = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file="/nonexistent/error.json")
        raise ChildFailedError("cembed", {0: failed})

    seen = _fake_run(monkeypatch, restart_once_then_fail)
    with pytest.raises(WorkerFailed) as err:
        launch(["train"], 2, max_restarts=2)
    assert issubclass(seen["agent"], torchs_agent) and seen["agent"] is not torchs_agent
    assert launcher_api.LocalElasticAgent is torchs_agent  # put back after the launch
    assert seen["args"].max_restarts == 2 and seen["env"][FRESH_STORE_PER_RESTART[0]] == "1"
    # torch's text when the worker recorded nothing is not shown: its output is
    assert (err.value.rank, err.value.exitcode, err.value.message) == (0, 1, "see its output above")
    assert (err.value.restarts, err.value.not_restarted) == (1, False)
    assert json.loads(os.environ[RESTARTS_ENV])[0]["reason"] == "rank 1 killed by SIGKILL"


def test_a_failed_worker_is_named_with_its_recorded_error(monkeypatch, tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    record_worker_error(UserError("pairs.jsonl: invalid JSON on line 3"))
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")

    def fail(agent_cls):
        late = ProcessFailure(local_rank=0, pid=1, exitcode=-15, error_file=str(tmp_path / "none.json"))
        first = ProcessFailure(local_rank=1, pid=2, exitcode=2, error_file=str(error_file))
        late.timestamp = first.timestamp + 5  # the first to fail is named
        raise ChildFailedError("cembed", {0: late, 1: first})

    _fake_run(monkeypatch, fail)
    policy = RestartPolicy(3)
    policy.refused = "rank 1 exited with code 2: UserError: pairs.jsonl: invalid JSON on line 3"
    with pytest.raises(WorkerFailed) as err:
        launch(["train"], 2, max_restarts=3, policy=policy)
    assert str(err.value) == "rank 1 failed with exit code 2: UserError: pairs.jsonl: invalid JSON on line 3"
    assert (err.value.restarts, err.value.not_restarted) == (0, True)
    with pytest.raises(WorkerFailed) as err:
        launch(["train"], 2)  # no policy: no restarts, none refused
    assert (err.value.rank, err.value.restarts, err.value.not_restarted) == (1, 0, False)


def test_a_signal_to_the_launcher_is_launcher_signalled(monkeypatch):
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def signalled(agent_cls):
        raise SignalException("Process 1 got signal: 15", sigval=signal.SIGTERM)

    def signalled_again(agent_cls):
        try:
            signalled(agent_cls)
        except SignalException:
            raise SignalException("Process 1 got signal: 2", sigval=signal.SIGINT)  # noqa: B904 - as torch's agent

    for effect, signum, abandoned in ((signalled, signal.SIGTERM, False), (signalled_again, signal.SIGINT, True)):
        _fake_run(monkeypatch, effect)
        with pytest.raises(LauncherSignalled) as err:
            launch(["train"], 2)
        assert (err.value.signum, err.value.abandoned, err.value.exit_code) == (signum, abandoned, 128 + signum)


def test_the_agent_asks_the_policy_only_while_restarts_are_left(monkeypatch):
    """torch's agent restarts while ``_remaining_restarts`` > 0: with one left a user error still ends
    the job at once; with none left the policy is not asked (no restart line, no record)."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from cembed.distributed.launch import policy_agent

    groups, failures = [], {}

    def monitor(self, group):
        groups.append(group)  # torch's own check of the worker group it is given
        return RunResult(WorkerState.FAILED, failures=failures)

    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", monitor)
    lines = []
    policy = RestartPolicy(2, announce=lines.append)
    agent = object.__new__(policy_agent(policy))
    group = object()
    failures[0] = SimpleNamespace(exitcode=1, message={"extraInfo": {}}, timestamp=1)  # no message recorded
    agent._remaining_restarts = 0
    agent._monitor_workers(group)
    assert groups == [group] and policy.restarts == [] and lines == []
    agent._remaining_restarts = 1
    agent._monitor_workers(group)
    assert lines == ["restart 1 of 2: starting again (no checkpoint yet) (rank 0 exited with code 1)"]
    failures[0] = SimpleNamespace(exitcode=2, message={"message": "UserError: bad"}, timestamp=2)
    agent._monitor_workers(group)  # one restart left: not used on a user error
    assert agent._remaining_restarts == 0 and policy.refused == "rank 0 exited with code 2: UserError: bad"
    assert len(lines) == 1 and groups == [group] * 3
