"""The torch.distributed process group of a multi-process (multi-GPU, multi-node) run.

cembed does not run its own process engine: ``cembed train --nproc-per-node N`` hands the command to
torch's elastic launcher (:mod:`cembed.distributed.launch`), which starts N workers per node running
``python -m cembed train ...`` with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` set. Each worker joins the process group (NCCL on CUDA, gloo on CPU) and trains
through the sentence-transformers trainer, which wraps the model in ``DistributedDataParallel`` via
accelerate (:mod:`cembed.distributed.ddp`) or shards it (:mod:`cembed.distributed.fsdp`).

What this module holds:

- :func:`init_distributed`: join the group early (with ``distributed.timeout_minutes`` as the
  collectives' timeout) and pick this rank's device, so that the pre-tokenization cache can be
  written by one process per node (:func:`local_main_first`).
- :func:`main_first`: single-rank work (the first pre-tokenization, "before training" evaluation)
  while the other ranks wait on the process group's store, not in a collective, so its length is
  bounded by no collective timeout.
- :func:`leave_process_group`: the clean shutdown before a worker exits.
- :func:`exit_worker`: end a launched worker without interpreter finalization.

The collectives the ranks agree through are in :mod:`cembed.distributed.collectives`.

Exactness: sentence-transformers' gathered MNRL gives each rank the mean loss over *its own* anchors
(scored against all ranks' candidates), and the all-gather's backward sums the gradients that every
rank's loss sends to each embedding, so each rank's parameter gradient is ``world_size x`` its share
of the full-batch gradient; DDP's average over ranks then yields exactly the gradient of the
full-batch loss (the mean of the per-rank losses). ``tests/distributed/test_distributed.py`` checks loss and
updated weights against one process on the whole batch.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from cembed.errors import UserError


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job, from the launcher's environment (1 process when unset)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that prints progress and writes outputs."""
        return self.rank == 0


def dist_info() -> DistInfo:
    """Read ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` (set by torchrun;
    ``LOCAL_WORLD_SIZE`` defaults to ``WORLD_SIZE``, which only holds on one node: init_distributed
    checks ``LOCAL_RANK`` against the visible GPUs when it is missing)."""
    env = os.environ
    world = int(env.get("WORLD_SIZE", "1"))
    return DistInfo(
        rank=int(env.get("RANK", "0")),
        local_rank=int(env.get("LOCAL_RANK", "0")),
        world_size=world,
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world))),
    )


def is_worker() -> bool:
    """True inside a process started by the launcher for a job of more than one process."""
    return dist_info().world_size > 1 and "RANK" in os.environ


def backend_for(device: str) -> str:
    """``nccl`` for CUDA devices, ``gloo`` for CPU."""
    return "nccl" if device.startswith("cuda") else "gloo"


def init_distributed(device: str, timeout_minutes: float = 60.0) -> str:
    """Join the launcher's process group (``env://``) and return this rank's device.

    Args:
        device: the plan's device, ``cpu`` or ``cuda``.
        timeout_minutes: how long a collective waits for the other ranks before the job fails
            (``distributed.timeout_minutes``; NCCL's own default is 10 minutes).

    Returns:
        ``cuda:<LOCAL_RANK>`` for CUDA (also made the current device), else ``device`` unchanged.
        Without a multi-process environment nothing is initialized and ``device`` is returned.

    Raises:
        UserError: more processes on this node than visible GPUs, or CUDA without LOCAL_RANK.
    """
    import torch.distributed as dist

    info = dist_info()
    if info.world_size == 1:
        return device
    if device.startswith("cuda"):
        if "LOCAL_RANK" not in os.environ:
            raise UserError(
                f"WORLD_SIZE={info.world_size} but LOCAL_RANK is not set, so every process would use GPU 0: start "
                "the job with `cembed train --nproc-per-node N` (or torchrun), or have the launcher set LOCAL_RANK "
                "(the process's index on its node) and LOCAL_WORLD_SIZE (processes on the node)"
            )
        visible = torch.cuda.device_count()
        if "LOCAL_WORLD_SIZE" in os.environ and info.local_world_size > visible:
            raise UserError(
                f"--nproc-per-node {info.local_world_size}: only {visible} CUDA device(s) are visible on this node; "
                f"start at most {visible} processes per node"
            )
        if info.local_rank >= visible:  # launchers that do not set LOCAL_WORLD_SIZE (e.g. srun)
            raise UserError(
                f"LOCAL_RANK {info.local_rank}: only {visible} CUDA device(s) are visible on this node; "
                f"start at most {visible} processes per node"
            )
        torch.cuda.set_device(info.local_rank)
        device = f"cuda:{info.local_rank}"
    if not dist.is_initialized():
        from datetime import timedelta

        dist.init_process_group(backend=backend_for(device), timeout=timedelta(minutes=timeout_minutes))
    return device


def leave_process_group() -> None:
    """Shut this process's group down (``torch.distributed.destroy_process_group``) before it exits.

    Call once per process, on every rank, after its last collective, and only when no rank failed
    (NCCL's teardown is collective: a failed rank waiting in it would hang instead of exiting). No
    barrier is needed: after training, nothing uses the group, and NCCL's teardown itself waits for
    the other ranks, e.g. for rank 0 to finish saving and evaluating. Why at all: left to interpreter
    exit, a gloo/NCCL thread that still needs the GIL while Python finalizes aborts the process
    ("terminate called without an active exception", SIGABRT), which the launcher reports as a
    failed rank although training succeeded. A no-op without an initialized group.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def exit_worker(code: int = 0) -> None:
    """End this launched worker with exit ``code`` now, skipping Python's interpreter finalization;
    returns (does nothing) outside a launched multi-process job.

    Why: the gloo group outlives ``destroy_process_group`` (DDP's reducer, held in reference cycles
    around the trainer, keeps it: a two-rank CPU run still has gloo's threads after it), and freeing
    it while a gloo thread releases a finished work's tensors fails either way: at interpreter
    finalization the thread aborts the process (``terminate called without an active exception``,
    SIGABRT; seen in CI on rank 1 of a run that had finished all its steps), and freed earlier from
    Python (a ``gc.collect()``), the group's destructor waits for the thread's mutex while holding
    the GIL the thread needs: a hang (seen on rank 0 of a two-rank run; gdb showed
    ``~ProcessGroupGloo`` waiting on the mutex and ``pt_gloo_runloop`` waiting for the GIL).
    pytorch/pytorch#179291 proposed an upstream fix and was abandoned. So a worker never frees the
    group: everything a run keeps is already written atomically and closed; this flushes the log
    handlers and standard streams, then leaves with ``os._exit``. Called by the CLI's entry point
    (:func:`cembed.cli.app.main`) for every command a launched worker runs, whatever its exit code.
    """
    if not is_worker():
        return
    import logging
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be shown anyway
            pass
    os._exit(code)


_MAIN_FIRST_WAIT_S = 7 * 24 * 3600.0  # a failed first rank ends the job through the launcher
_main_first_calls = 0


@contextmanager
def main_first(local: bool = False, run_on_others: bool = True):
    """Run the body on rank 0 (``local``: on each node's local rank 0) first; the other ranks wait,
    then run it too (``run_on_others``) or skip it (the context yields whether this rank runs it).

    The others wait on the process group's key-value store (``store.wait``), not in a collective: a
    long first run (the first pre-tokenization of a large set, "before training" evaluation) is not
    cut off by the group's collective timeout, and the waiting ranks hold no NCCL collective. The
    first rank releases them even when its body raises. Every rank must enter it at the same point
    (the key counts the calls). A no-op (yields True) without an initialized multi-process group.
    """
    global _main_first_calls
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        yield True
        return
    from datetime import timedelta

    info = dist_info()
    _main_first_calls += 1
    first = info.local_rank == 0 if local else info.rank == 0
    # The node: torchrun's GROUP_RANK, else the rank's block of local_world_size (launchers number ranks node by node).
    node = os.environ.get("GROUP_RANK", str(info.rank // max(1, info.local_world_size))) if local else "0"
    key = f"cembed/main_first/{_main_first_calls}/{node}"
    store = dist.distributed_c10d._get_default_store()
    if first:
        try:
            yield True
        finally:
            store.set(key, "done")
        return
    store.wait([key], timedelta(seconds=_MAIN_FIRST_WAIT_S))
    yield run_on_others


@contextmanager
def local_main_first():
    """Run the body on each node's local rank 0 first, then on the node's other ranks (which wait
    on the store, not in a collective: :func:`main_first`).

    For work that fills an on-disk cache (pre-tokenization): the first process writes it, the
    others load it. A no-op without an initialized multi-process group.
    """
    with main_first(local=True):
        yield
