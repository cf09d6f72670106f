"""Starting a multi-process job: ``cembed train --nproc-per-node N`` runs through torch's elastic
launcher (``torch.distributed.run``, the code behind ``torchrun``).

- :func:`launch`: build the launcher's arguments (:func:`launcher_args`: ``--nnodes``,
  ``--node-rank``, ``--rdzv-endpoint`` passed through) and turn a failed worker into
  :class:`~cembed.errors.WorkerFailed` naming the rank and its error. The launcher stops the other
  workers as soon as one fails.
- :class:`RestartPolicy`: with ``--max-restarts``, torch's elastic agent restarts the workers after
  any failure; cembed's agent restarts them only where a restart can help (a crash, a killed rank, a
  collective timeout), not after a user error (exit code 2: a config or data mistake, found while
  loading or at any later step, fails every attempt alike). Each restart is announced and recorded
  for the run's summary (:func:`restarts_record`).
- :func:`record_worker_error`: write a worker's exception where the launcher reads it, so the
  launching process can show the failing rank's message.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

from cembed.errors import LauncherSignalled, UserError, WorkerFailed

# On one node torchrun meets in a c10d rendezvous whose TCP store it lends the workers and keeps across
# restarts. Restarted that way, the workers never formed their process group again (2 gloo ranks:
# still waiting after 600 s; earlier "Gloo connectFullMesh failed ... Connection refused";
# pytorch/pytorch#135712 reports the same with NCCL, which read the previous attempt's unique id from
# the kept store). torch's opt-out gives every rendezvous round a store of its own, hosted by the
# round's rank 0 on a fresh port; with it the restart resumes and finishes (tests/distributed/test_preemption.py).
FRESH_STORE_PER_RESTART = ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")

# Set by launch() for its workers: the launching process shows their failures and signals in one line
# (a worker then does not print the same line again).
LAUNCHED_BY_CEMBED = "CEMBED_LAUNCHER"
# The restarts so far (JSON, a list of restart_entry dicts), set by the launching process for the
# workers of each restart: run_summary.json records them.
RESTARTS_ENV = "CEMBED_RESTARTS"
# A worker's exit codes no restart can change: 2, a UserError (a config or data mistake).
NO_RESTART_EXIT_CODES = frozenset({2})
# The signals torch's launcher catches and forwards to its workers (torchrun's --signals-to-handle):
# torch's default and SIGUSR1, which Slurm's --signal=USR1@120 and submitit send before a time limit
# (pytorch/pytorch#154849). The workers stop on each as on SIGTERM (cembed.train.checkpoint.STOP_SIGNALS);
# without it in the list the launcher dies of SIGUSR1 at once and its workers save nothing.
LAUNCHER_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1")


def launcher_signals() -> str:
    """torchrun's ``--signals-to-handle`` for cembed's launcher: :data:`LAUNCHER_SIGNALS` that this
    platform has, less SIGHUP where this process ignores it (``nohup``: the job is meant to outlive its
    terminal, and the workers inherit the ignored signal). ``$PET_SIGNALS_TO_HANDLE`` (torchrun's own
    variable) replaces the list."""
    if os.environ.get("PET_SIGNALS_TO_HANDLE"):
        return os.environ["PET_SIGNALS_TO_HANDLE"]
    names = [name for name in LAUNCHER_SIGNALS if hasattr(signal, name)]
    if "SIGHUP" in names and signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
        names.remove("SIGHUP")
    return ",".join(names)


def launched_by_cembed() -> bool:
    """Whether this process is a worker that ``cembed train --nproc-per-node``'s launcher started."""
    return os.environ.get(LAUNCHED_BY_CEMBED) == "1"


def restartable(exitcode: int) -> bool:
    """Whether a worker that ended with ``exitcode`` may succeed when restarted: not after a user
    error (:data:`NO_RESTART_EXIT_CODES`); after a crash (1), a failed run (3: a collective timeout,
    a lost peer) or a signal (negative: a killed process) yes."""
    return exitcode not in NO_RESTART_EXIT_CODES


def failure_reason(rank: int, exitcode: int, message: str | None) -> str:
    """A failed worker in a few words: ``rank 1 killed by SIGKILL``, ``rank 0 exited with code 3: <its
    error's first line>``."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"rank {rank} killed by {name}"
    text = (message or "").strip().splitlines()[0][:200] if (message or "").strip() else ""
    return f"rank {rank} exited with code {exitcode}" + (f": {text}" if text else "")


@dataclass
class RestartPolicy:
    """What cembed's elastic agent does when the workers fail (``--max-restarts``).

    Args:
        max_restarts: restarts allowed.
        resume_point: the checkpoint a restart resumes from, as shown (``checkpoint-4``), or None
            (no complete checkpoint yet: the restart starts again).
        announce: shows one line (``restart 1 of 2: resuming from checkpoint-4 (rank 1 killed by SIGKILL)``).
    """

    max_restarts: int
    resume_point: Callable[[], str | None] = lambda: None
    announce: Callable[[str], None] = lambda line: None
    restarts: list[dict] = field(default_factory=list)  # what each restart resumed from and why
    refused: str | None = None  # why the last failure was not restarted (a user error)

    def restart(self, rank: int, exitcode: int, message: str | None) -> bool:
        """Whether to restart after rank ``rank`` (the first to fail) ended with ``exitcode`` and
        ``message``; a restart is announced and recorded (also in ``$CEMBED_RESTARTS`` for the workers)."""
        reason = failure_reason(rank, exitcode, message)
        if not restartable(exitcode):
            self.refused = reason
            return False
        if len(self.restarts) >= self.max_restarts:
            return False
        point = self.resume_point()
        entry = {"restart": len(self.restarts) + 1, "of": self.max_restarts, "resumed_from": point, "reason": reason}
        self.restarts.append(entry)
        os.environ[RESTARTS_ENV] = json.dumps(self.restarts)
        self.announce(restart_line(entry))
        return True


def restart_line(entry: dict) -> str:
    """``restart k of N: resuming from checkpoint-S (reason)`` (or ``starting again``, no checkpoint yet)."""
    point = f"resuming from {entry['resumed_from']}" if entry["resumed_from"] else "starting again (no checkpoint yet)"
    return f"restart {entry['restart']} of {entry['of']}: {point} ({entry['reason']})"


def restarts_record(count: int | None = None) -> list[dict]:
    """The restarts of this job so far, for ``run_summary.json``: the launching process's record
    (:class:`RestartPolicy`) where cembed launched it; under ``torchrun`` by hand, or on a node whose
    launcher restarted healthy workers (:func:`job_restart_count`), only the count is known (entries
    without a reason). Empty on a first attempt.

    Args:
        count: the job's restarts (:func:`job_restart_count`); None: this worker's own
            ``$TORCHELASTIC_RESTART_COUNT``.
    """
    try:
        recorded = json.loads(os.environ.get(RESTARTS_ENV, "") or "[]")
    except ValueError:
        recorded = []
    count = restart_count() if count is None else count
    if isinstance(recorded, list) and len(recorded) == count:
        return recorded
    return [{"restart": k, "of": None, "resumed_from": None, "reason": None} for k in range(1, count + 1)]


def policy_agent(policy: RestartPolicy):
    """A subclass of torch's ``LocalElasticAgent`` that asks ``policy`` before it restarts a failed
    worker group: its check of the workers ends the restarts left when the first failure (by time)
    is one no restart changes (:meth:`RestartPolicy.restart`); the agent then stops the workers and
    reports that failure, as when none are left."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class PolicyAgent(LocalElasticAgent):
        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            if result.is_failed() and self._remaining_restarts > 0:
                rank = min(result.failures, key=lambda r: result.failures[r].timestamp)
                failure = result.failures[rank]
                if not policy.restart(rank, failure.exitcode, _message(failure.message)):
                    self._remaining_restarts = 0  # the agent then stops the workers and returns the failure
            return result

    return PolicyAgent


@contextmanager
def _agent(policy: RestartPolicy | None):
    """torch's launcher builds its agent from ``torch.distributed.launcher.api.LocalElasticAgent``:
    for the launch, that name is cembed's :func:`policy_agent`."""
    if policy is None:
        yield
        return
    import torch.distributed.launcher.api as launcher_api

    original = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = policy_agent(policy)
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = original


def _message(message) -> str:
    """A worker's recorded error as text (the error file's ``{"message": ..., "extraInfo": ...}``)."""
    if isinstance(message, dict):
        message = message.get("message", "")
    if not isinstance(message, str) or "elastic/errors.html" in message:  # torch's text when none was recorded
        return ""
    return message


def record_worker_error(err: BaseException) -> bool:
    """Write ``err`` to the error file the launcher reads (``$TORCHELASTIC_ERROR_FILE``), so the
    launching process can name the failing rank and show its message. A no-op outside a launcher.

    Returns:
        Whether cembed's own launcher will show it (the worker need not print the same line).
    """
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return False
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    handler = get_error_handler()
    handler.initialize()
    handler.record_exception(err)
    return launched_by_cembed()


def restart_count() -> int:
    """How often torch's elastic agent has restarted this worker's group after a failure
    (``$TORCHELASTIC_RESTART_COUNT``, set by the launcher; 0 on the first attempt and outside a launcher)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


def job_restart_count() -> int:
    """How often the job's workers have been restarted after a failure, as the whole job counts it:
    the largest :func:`restart_count` over the ranks (a collective: every rank calls it at the same
    point, in the process group; this worker's own count without one).

    Why not each worker's own: torch's elastic agent counts a restart on the node whose worker failed
    only. The agents of the other nodes see the failed node back in the rendezvous and restart their
    healthy workers without counting it (pytorch/pytorch#108158), so those would start the run afresh
    while the failed node's resume it."""
    from cembed.distributed.collectives import max_over_ranks

    return max_over_ranks(restart_count())


def launcher_args(
    module: str,
    module_args: list[str],
    nproc_per_node: int,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    max_restarts: int = 0,
) -> list[str]:
    """The ``torchrun`` command line (without the program name) that runs ``python -m module module_args``
    in ``nproc_per_node`` processes on each of ``nnodes`` nodes; when a worker fails, the launcher
    restarts them all up to ``max_restarts`` times (torchrun's ``--max-restarts``; across nodes through
    torchrun's c10d rendezvous, which re-forms the group after a restart).

    Raises:
        UserError: a count below 1 (below 0 for ``max_restarts``), a node rank outside ``[0, nnodes)``,
            or several nodes without ``--rdzv-endpoint`` (every node must know where rank 0's node listens).
    """
    if max_restarts < 0:
        raise UserError(f"--max-restarts {max_restarts}: give 0 (no restart) or more")
    if nproc_per_node < 1:
        raise UserError(f"--nproc-per-node {nproc_per_node}: give at least 1 process per node")
    if nnodes < 1:
        raise UserError(f"--nnodes {nnodes}: give at least 1 node")
    if not 0 <= node_rank < nnodes:
        raise UserError(f"--node-rank {node_rank}: must be between 0 and --nnodes - 1 ({nnodes - 1})")
    if nnodes > 1 and not rdzv_endpoint:
        raise UserError(
            f"--nnodes {nnodes}: also give --rdzv-endpoint HOST:PORT, the address of node 0 that every node can reach"
        )
    argv = ["--nproc-per-node", str(nproc_per_node), "--nnodes", str(nnodes), "--node-rank", str(node_rank)]
    if rdzv_endpoint:
        argv += ["--rdzv-endpoint", rdzv_endpoint]
    if max_restarts:
        argv += ["--max-restarts", str(max_restarts)]
    if max_restarts and nnodes > 1:
        # torchrun's default with --rdzv-endpoint is the static rendezvous, whose restarted workers on
        # several nodes never connected again (Gloo connectFullMesh failed, measured on two nodes);
        # the c10d rendezvous re-forms the group (docs/preemptible.md)
        argv += ["--rdzv-backend", "c10d"]
    return argv + ["--module", module, *module_args]


def launch(
    module_args: list[str],
    nproc_per_node: int,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    module: str = "cembed",
    max_restarts: int = 0,
    policy: RestartPolicy | None = None,
    shutdown_timeout_s: int | None = None,
) -> None:
    """Run ``python -m <module> <module_args>`` in ``nproc_per_node`` worker processes through torch's
    elastic launcher, as ``torchrun --signals-to-handle <launcher_signals()> <launcher_args(...)>``
    would, and wait for all of them.

    Single node without ``rdzv_endpoint``: the launcher picks a free local port. Several nodes: run
    the same command on every node with its own ``node_rank`` and node 0's ``rdzv_endpoint``.

    A signal to this process (SIGTERM from a scheduler's preemption, SIGINT, SIGUSR1 from Slurm's
    ``--signal``, SIGHUP; :func:`launcher_signals`) reaches every worker
    (the launcher forwards it and waits ``shutdown_timeout_s``, default ``$TORCH_ELASTIC_SHUTDOWN_TIMEOUT``
    or 30 s, before killing them): each finishes its step and saves, see
    :class:`cembed.train.checkpoint.InterruptCallback`. With ``max_restarts``, every restart's workers
    meet in a store of their own (:data:`FRESH_STORE_PER_RESTART`), and ``policy`` (default: restart
    after any failure but a user error) decides each restart.

    Raises:
        UserError: see :func:`launcher_args`.
        WorkerFailed: a worker exited non-zero and was not restarted (``max_restarts`` used up, or a
            user error); the launcher has already stopped the others.
        LauncherSignalled: this process got a termination signal and the workers were stopped
            (``abandoned``: a second one, and the workers stopped without saving).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    argv = launcher_args(module, module_args, nproc_per_node, nnodes, node_rank, rdzv_endpoint, max_restarts)
    args = get_args_parser().parse_args(argv)
    args.signals_to_handle = launcher_signals()
    # A worker killed by a fatal signal (SIGSEGV, SIGABRT from native code) prints every thread's
    # Python stack first, so the launcher's "rank N failed" comes with where it happened.
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")
    os.environ[LAUNCHED_BY_CEMBED] = "1"
    os.environ.pop(RESTARTS_ENV, None)
    if shutdown_timeout_s is not None:
        os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(shutdown_timeout_s))
    if max_restarts:
        os.environ.setdefault(*FRESH_STORE_PER_RESTART)
        policy = policy or RestartPolicy(max_restarts)
    try:
        with _agent(policy if max_restarts else None):
            run(args)
    except SignalException as err:
        # A second signal reaches the launcher while it waits for the workers to save: torch's agent
        # raises it while handling the first (its __context__) and, on the way out, signals the workers
        # still running once more, which makes them abandon their step (InterruptCallback).
        abandoned = isinstance(err.__context__, SignalException)
        raise LauncherSignalled(int(err.sigval), abandoned) from None
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        message = _message(failure.message).strip() or "see its output above"
        restarts = len(policy.restarts) if policy is not None else 0
        refused = policy is not None and policy.refused is not None
        raise WorkerFailed(rank, failure.exitcode, message, restarts, refused) from None
