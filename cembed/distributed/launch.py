"""Starting a multi-process job: ``cembed train --nproc-per-node N`` runs through torch's elastic
launcher (``torch.distributed.run``, the code behind ``torchrun``).

- :func:`launch`: build the launcher's arguments (:func:`launcher_args`: ``--nnodes``,
  ``--node-rank``, ``--rdzv-endpoint`` passed through) and turn a failed worker into
  :class:`~cembed.errors.WorkerFailed` naming the rank and its error. The launcher stops the other
  workers as soon as one fails.
- :func:`record_worker_error`: write a worker's exception where the launcher reads it, so the
  launching process can show the failing rank's message.
"""

from __future__ import annotations

import os

from cembed.errors import LauncherSignalled, UserError, WorkerFailed

# On one node torchrun meets in a c10d rendezvous whose TCP store it lends the workers and keeps across
# restarts. Restarted that way, the workers never formed their process group again (2 gloo ranks:
# still waiting after 600 s; earlier "Gloo connectFullMesh failed ... Connection refused";
# pytorch/pytorch#135712 reports the same with NCCL, which read the previous attempt's unique id from
# the kept store). torch's opt-out gives every rendezvous round a store of its own, hosted by the
# round's rank 0 on a fresh port; with it the restart resumes and finishes (tests/distributed/test_preemption.py).
FRESH_STORE_PER_RESTART = ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")


def record_worker_error(err: BaseException) -> None:
    """Write ``err`` to the error file the launcher reads (``$TORCHELASTIC_ERROR_FILE``), so the
    launching process can name the failing rank and show its message. A no-op outside a launcher."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    handler = get_error_handler()
    handler.initialize()
    handler.record_exception(err)


def restart_count() -> int:
    """How often torch's elastic agent has restarted this worker's group after a failure
    (``$TORCHELASTIC_RESTART_COUNT``, set by the launcher; 0 on the first attempt and outside a launcher)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


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
    restarts them all up to ``max_restarts`` times (torchrun's ``--max-restarts``).

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
    return argv + ["--module", module, *module_args]


def launch(
    module_args: list[str],
    nproc_per_node: int,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    module: str = "cembed",
    max_restarts: int = 0,
) -> None:
    """Run ``python -m <module> <module_args>`` in ``nproc_per_node`` worker processes through torch's
    elastic launcher, exactly as ``torchrun <launcher_args(...)>`` would, and wait for all of them.

    Single node without ``rdzv_endpoint``: the launcher picks a free local port. Several nodes: run
    the same command on every node with its own ``node_rank`` and node 0's ``rdzv_endpoint``.

    A signal to this process (SIGTERM from a scheduler's preemption, SIGINT) reaches every worker
    (the launcher forwards it and waits ``$TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, default 30 s, before
    killing them): each finishes its step and saves, see :class:`cembed.train.checkpoint.InterruptCallback`.
    With ``max_restarts``, every restart's workers meet in a store of their own (:data:`FRESH_STORE_PER_RESTART`).

    Raises:
        UserError: see :func:`launcher_args`.
        WorkerFailed: a worker exited non-zero (after ``max_restarts`` restarts); the launcher has
            already stopped the others.
        LauncherSignalled: this process got a termination signal and the workers were stopped
            (``abandoned``: a second one, and the workers stopped without saving).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    argv = launcher_args(module, module_args, nproc_per_node, nnodes, node_rank, rdzv_endpoint, max_restarts)
    args = get_args_parser().parse_args(argv)
    # A worker killed by a fatal signal (SIGSEGV, SIGABRT from native code) prints every thread's
    # Python stack first, so the launcher's "rank N failed" comes with where it happened.
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")
    if max_restarts:
        os.environ.setdefault(*FRESH_STORE_PER_RESTART)
    try:
        run(args)
    except SignalException as err:
        # A second signal reaches the launcher while it waits for the workers to save: torch's agent
        # raises it while handling the first (its __context__) and, on the way out, signals the workers
        # still running once more, which makes them abandon their step (InterruptCallback).
        abandoned = isinstance(err.__context__, SignalException)
        raise LauncherSignalled(int(err.sigval), abandoned) from None
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        message = failure.message
        if isinstance(message, dict):  # the error file's {"message": ..., "extraInfo": ...}
            message = message.get("message", "")
        if not isinstance(message, str) or "elastic/errors.html" in message or not message.strip():
            message = "see its output above"
        raise WorkerFailed(rank, failure.exitcode, message.strip()) from None
